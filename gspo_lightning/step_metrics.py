"""What ``training_step`` logs: the objective's stats and the diagnostics that explain a run.

Orchestration only: the numbers come from the pure functions in ``objectives`` and ``diagnostics``.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor

from gspo_lightning.diagnostics import by_lag, length_bucket_edges, ratio_diagnostics, sequence_ratios
from gspo_lightning.metric_logging import log_across_ranks, shows_progress_bar
from gspo_lightning.objectives import mismatch_stats
from gspo_lightning.objectives.gspo import sequence_log_ratio
from gspo_lightning.rollout.types import Minibatch


def log_step_metrics(
    module: pl.LightningModule,
    loss: Tensor,
    stats: dict[str, Tensor],
    logprobs: Tensor,
    minibatch: Minibatch,
    minibatch_index: int,
) -> None:
    """Log loss and stats under ``train/``, diagnostics under ``diag/``, off-policy drift per minibatch index."""
    size = len(minibatch)
    diagnostics = ratio_diagnostics(
        logprobs,
        minibatch.old_logprobs,
        minibatch.advantages,
        minibatch.response_mask,
        module.eps_low,
        module.eps_high,
        ratio_level=module.objective.ratio,
        length_edges=length_bucket_edges(module.hparams.max_new_tokens),
        lags=minibatch.policy_lag,
    )
    log_across_ranks(module, {"train/loss": loss.detach()}, size)
    if shows_progress_bar(module):
        module.log("loss", loss.detach(), prog_bar=True, logger=False, batch_size=size)
    log_across_ranks(module, {f"train/{name}": value for name, value in stats.items()}, size)
    log_across_ranks(module, {f"diag/{name}": value for name, value in diagnostics.items()}, size)
    if minibatch.engine_logprobs is not None:
        log_across_ranks(module, behaviour_clip_fractions(module, logprobs, minibatch), size)
    # One series per minibatch index: drift grows from ~0 at the first minibatch of a round to the K-th.
    drift = per_index_series("drift/kl_old_theta_mb", diagnostics["kl_old_theta"], minibatch_index)
    log_across_ranks(module, drift, size)
    histogram_loggers = [logger for logger in module.loggers if isinstance(logger, TensorBoardLogger)]
    if histogram_loggers:
        ratios = sequence_ratios(logprobs, minibatch.old_logprobs, minibatch.response_mask)  # [N_valid]
        for logger in histogram_loggers:
            logger.experiment.add_histogram("diag/seq_ratio", ratios, module.global_step)


def behaviour_clip_fractions(module: pl.LightningModule, logprobs: Tensor, minibatch: Minibatch) -> dict[str, Tensor]:
    """``diag/behaviour_clip_frac_resp`` (and ``_lag_<k>`` under asynchronous rollouts): the clip fraction had the
    objective's ratio been taken against the behaviour policy (the engine's log-probs: of stale weights when
    sampling runs ahead, of other kernels or precision always) instead of the trainer's pi_old. Trainers that use
    the behaviour log-probs as pi_old see this clip fraction (issue 28's staleness experiment)."""
    behaviour = ratio_diagnostics(
        logprobs,
        minibatch.engine_logprobs,
        minibatch.advantages,
        minibatch.response_mask,
        module.eps_low,
        module.eps_high,
        ratio_level=module.objective.ratio,
        lags=minibatch.policy_lag,
    )
    return {f"diag/behaviour_{name}": value for name, value in behaviour.items() if name.startswith("clip_frac")}


def per_index_series(prefix: str, value: Tensor, index: int) -> dict[str, Tensor]:
    """One series per minibatch index: ``value`` under ``<prefix><index>`` and nothing under the others, so each
    logger gets a value or no entry at all, never a NaN placeholder (TensorBoard rejects those, and a CSV cell
    stays empty). The module's :class:`StepMetrics` writes each step's own figures only, so no logger repeats a
    series' last value at the steps of other indices."""
    return {f"{prefix}{index}": value}


def log_expert_change(
    module: pl.LightningModule, per_layer: Tensor, size: int, minibatch_index: int
) -> None:
    """MoE routing drift: the fraction of (token, expert) activations pi_theta's routers choose that pi_old's did
    not, in total, per layer, and per minibatch index (updates since pi_old)."""
    total = per_layer.mean()
    metrics = {"moe/expert_change_frac": total}
    metrics |= per_index_series("moe/expert_change_mb", total, minibatch_index)
    metrics |= {f"moe/expert_change_frac_layer{layer}": value for layer, value in enumerate(per_layer)}
    log_across_ranks(module, metrics, size)


def log_rollout_route_change(module: pl.LightningModule, per_layer: Tensor, size: int) -> None:
    """R3's diagnostic: the fraction of the sampler's (token, expert) pairs the trainer's pi_old would have routed
    elsewhere, in total and per layer (what ``model.routing_replay: rollout`` changes)."""
    metrics = {"moe/rollout_vs_old_change_frac": per_layer.mean()}
    metrics |= {f"moe/rollout_vs_old_change_frac_layer{layer}": value for layer, value in enumerate(per_layer)}
    log_across_ranks(module, metrics, size)


def log_mismatch(module: pl.LightningModule, minibatch: Minibatch, correction_stats: dict[str, Tensor]) -> None:
    """``mismatch/*``: how far the engine's log-probs are from the trainer's pi_old, and what the rollout
    correction left out (``masked_frac``) or capped (``truncated_frac``)."""
    figures = mismatch_stats(minibatch.old_logprobs, minibatch.engine_logprobs, minibatch.response_mask)
    figures.update(correction_stats)
    if minibatch.policy_lag is not None:  # asynchronous: the correction's log-weight, log(pi_prox / pi_behav), by lag
        log_weight = sequence_log_ratio(minibatch.old_logprobs, minibatch.engine_logprobs, minibatch.response_mask)
        present = (minibatch.response_mask != 0).any(-1).float()  # [n]
        figures.update(by_lag(log_weight, present, minibatch.policy_lag, "log_ratio_mean"))
    log_across_ranks(module, {f"mismatch/{name}": value for name, value in figures.items()}, len(minibatch))

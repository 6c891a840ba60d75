"""Logging per-step figures so that a multi-rank run reports the whole run, not rank 0's share.

Each rank computes its figures on its own prompts (groups never span ranks); each value is reduced across ranks
with the operation that fits its meaning: means are averaged (ranks hold equal numbers of responses), counts
summed, ``*_max``/``*_min`` and timings take the extreme. Quantiles and standard deviations are averaged over
ranks, an approximation of the global figure.

A step logs about fifty figures. ``LightningModule.log`` costs a fraction of a millisecond per call, a quarter of
a tiny model's step in all, so the figures of a step are queued and written once at the end of the step: one
device-to-host copy, at most one collective (``all_gather``) across ranks, one ``log_metrics`` call per logger,
and ``trainer.callback_metrics`` updated so that callbacks can monitor them.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

SUMMED = frozenset(
    {"num_empty", "reward_errors", "groups_skipped", "prompts_truncated", "prompts_skipped", "nonfinite_loss",
     "groups_drawn", "groups_dropped", "groups_kept", "truncated_masked"}
)
"""Counts: the run's figure is the sum over ranks."""


def cross_rank_reduction(name: str) -> str:
    """How ``name`` combines across ranks: ``mean``, ``sum``, ``max`` or ``min``."""
    leaf = name.rsplit("/", 1)[-1]
    if name.startswith("time/") or leaf.endswith("_max"):
        return "max"  # the slowest rank sets the pace
    if leaf.endswith("_min") or leaf == "no_signal":
        return "min"  # no_signal: 1 only when no rank had any
    if leaf in SUMMED:
        return "sum"
    return "mean"


_QUEUE = "_gspo_queued_metrics"  # trainer attribute: {step: {name: value}} waiting for flush_step_metrics
_REDUCE = {"mean": torch.mean, "sum": torch.sum, "max": torch.amax, "min": torch.amin}


def log_across_ranks(module: pl.LightningModule, metrics: dict[str, Any], batch_size: int = 1, **kwargs: Any) -> None:
    """Queue this step's ``metrics`` (scalars or 0-d tensors) for :func:`flush_step_metrics`, which reduces them
    across ranks by :func:`cross_rank_reduction` and writes them. Without a trainer (a module used on its own)
    they go to ``module.log``. ``batch_size`` and ``kwargs`` are accepted for ``module.log``'s signature."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None:
        for name, value in metrics.items():
            module.log(name, value, batch_size=batch_size)
        return
    if not hasattr(trainer, _QUEUE):
        setattr(trainer, _QUEUE, {})
    step = trainer.fit_loop.epoch_loop._batches_that_stepped  # the step Lightning's own logging uses
    getattr(trainer, _QUEUE).setdefault(step, {}).update(metrics)


def flush_step_metrics(trainer: pl.Trainer) -> None:
    """Write the queued figures (see :func:`log_across_ranks`); call it at the end of a training step, on every
    rank. ``trainer.callback_metrics`` gets every step's figures; the loggers those of the steps
    ``trainer.log_every_n_steps`` selects, as with ``LightningModule.log``."""
    for step, metrics in sorted(getattr(trainer, _QUEUE, {}).items()):
        to_loggers = trainer.log_every_n_steps > 0 and (step + 1) % trainer.log_every_n_steps == 0
        _write(trainer, step, metrics, to_loggers)
    setattr(trainer, _QUEUE, {})


def _write(trainer: pl.Trainer, step: int, metrics: dict[str, Any], to_loggers: bool) -> None:
    names = list(metrics)
    device = trainer.strategy.root_device
    values = torch.stack([torch.as_tensor(metrics[n], dtype=torch.float32, device=device).reshape(()) for n in names])
    if trainer.world_size > 1:
        gathered = trainer.strategy.all_gather(values)  # [ranks, M]: one collective for every figure
        values = torch.stack([_REDUCE[cross_rank_reduction(n)](gathered[:, i]) for i, n in enumerate(names)])
    trainer.callback_metrics.update(zip(names, values.detach().unbind(), strict=True))
    if to_loggers and trainer.loggers:
        scalars = dict(zip(names, values.tolist(), strict=True))  # the step's one device-to-host copy
        for logger in trainer.loggers:
            logger.log_metrics(scalars, step=step)


def shows_progress_bar(module: pl.LightningModule) -> bool:
    """Whether the module's trainer has a progress bar to show figures on (``module.log(prog_bar=True)`` costs)."""
    trainer = getattr(module, "_trainer", None)
    return trainer is not None and trainer.progress_bar_callback is not None

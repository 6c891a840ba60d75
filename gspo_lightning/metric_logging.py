"""Logging per-step figures so that a multi-rank run reports the whole run, not rank 0's share.

Each rank computes its figures on its own prompts (groups never span ranks); each value is reduced across ranks
with the operation that fits its meaning: means are averaged (ranks hold equal numbers of responses), counts
summed, ``*_max``/``*_min`` and timings take the extreme. Quantiles and standard deviations are averaged over
ranks, an approximation of the global figure.

A step logs about fifty figures, from the module, the sampler and the non-finite guard. ``LightningModule.log``
costs a fraction of a millisecond per call (a quarter of a tiny model's step for fifty), and ``sync_dist`` one
collective per figure, so a module that owns a :class:`StepMetrics` (``GSPOModule`` does) collects them and writes
them once at the end of the step: one device-to-host copy, at most one collective (``all_gather``) across ranks, one
``log_metrics`` call per logger, and ``trainer.callback_metrics`` updated with the reduced values. Any other
LightningModule gets the same figures through ``LightningModule.log``.
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

_REDUCE = {"mean": torch.mean, "sum": torch.sum, "max": torch.amax, "min": torch.amin}


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


def attached_trainer(module: pl.LightningModule) -> pl.Trainer | None:
    """The module's trainer, or None for a module used on its own."""
    try:
        return module.trainer
    except (RuntimeError, AttributeError):  # "... is not attached to a `Trainer`"; not a LightningModule at all
        return None


class StepMetrics:
    """The figures of one training step, from every producer, written once by the module that owns it.

    Callbacks see each figure in ``trainer.callback_metrics`` as soon as it is added (this rank's value, as
    ``LightningModule.log`` without ``sync_dist`` gives them), so a ``ModelCheckpoint`` monitoring one at the end of
    the step finds it; the end-of-step write replaces them with the values reduced across ranks.
    """

    def __init__(self) -> None:
        self.figures: dict[str, Any] = {}

    def add(self, metrics: dict[str, Any], trainer: pl.Trainer) -> None:
        self.figures.update(metrics)
        trainer.callback_metrics.update({name: torch.as_tensor(value).detach() for name, value in metrics.items()})

    def write(self, trainer: pl.Trainer, step: int) -> None:
        """Reduce the step's figures across ranks (:func:`cross_rank_reduction`) and write them; on every rank.

        ``trainer.callback_metrics`` gets every step's figures; the loggers those of the steps
        ``trainer.log_every_n_steps`` selects, as with ``LightningModule.log``.
        """
        figures, self.figures = self.figures, {}
        if not figures:
            return
        names = list(figures)
        device = trainer.strategy.root_device
        values = torch.stack(
            [torch.as_tensor(figures[n], dtype=torch.float32, device=device).reshape(()) for n in names]
        )  # [M]
        if trainer.world_size > 1:
            gathered = trainer.strategy.all_gather(values)  # [ranks, M]: one collective for every figure
            values = torch.stack([_REDUCE[cross_rank_reduction(n)](gathered[:, i]) for i, n in enumerate(names)])
        trainer.callback_metrics.update(zip(names, values.detach().unbind(), strict=True))
        to_loggers = trainer.log_every_n_steps > 0 and (step + 1) % trainer.log_every_n_steps == 0
        if to_loggers and trainer.loggers:
            scalars = dict(zip(names, values.tolist(), strict=True))  # the step's one device-to-host copy
            for logger in trainer.loggers:
                logger.log_metrics(scalars, step=step)


def log_across_ranks(module: pl.LightningModule, metrics: dict[str, Any], batch_size: int = 1) -> None:
    """Log this step's ``metrics`` (scalars or 0-d tensors), reduced across ranks by :func:`cross_rank_reduction`:
    into the module's :class:`StepMetrics` when it has one (written at the end of the step), else through
    ``module.log`` (``sync_dist`` on several ranks)."""
    trainer = attached_trainer(module)
    queue = getattr(module, "step_metrics", None)
    if trainer is not None and isinstance(queue, StepMetrics):
        queue.add(metrics, trainer)
        return
    several = trainer is not None and trainer.world_size > 1
    for name, value in metrics.items():
        module.log(name, value, batch_size=batch_size, sync_dist=several, reduce_fx=cross_rank_reduction(name))


def shows_progress_bar(module: pl.LightningModule) -> bool:
    """Whether the module's trainer has a progress bar to show figures on (``module.log(prog_bar=True)`` costs)."""
    trainer = attached_trainer(module)
    return trainer is not None and trainer.progress_bar_callback is not None

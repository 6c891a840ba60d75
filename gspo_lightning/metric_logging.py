"""Logging per-step figures so that a multi-rank run reports the whole run, not rank 0's share.

Each rank computes its figures on its own prompts (groups never span ranks); Lightning then reduces each logged
value across ranks with the operation that fits its meaning: means are averaged (ranks hold equal numbers of
responses), counts summed, ``*_max``/``*_min`` and timings take the extreme. Quantiles and standard deviations
are averaged over ranks, an approximation of the global figure.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

SUMMED = frozenset({"num_empty", "reward_errors", "groups_skipped", "prompts_truncated", "prompts_skipped"})
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


def log_across_ranks(module: pl.LightningModule, metrics: dict[str, Any], batch_size: int, **kwargs: Any) -> None:
    """``module.log`` each metric, reduced across ranks (by :func:`cross_rank_reduction`) when there are several."""
    trainer = getattr(module, "_trainer", None)
    sync = trainer is not None and trainer.world_size > 1
    for name, value in metrics.items():
        module.log(name, value, batch_size=batch_size, sync_dist=sync, reduce_fx=cross_rank_reduction(name), **kwargs)

"""Sampling and scoring: from prompts to the minibatches the objective trains on (the round's core, no callbacks:
``GroupSampler`` and ``HeldOutEvaluation`` live in ``gspo_lightning.sampling``)."""

from typing import Any

from gspo_lightning.rollout.types import Minibatch, PromptBatch, Rollout

__all__ = ["Minibatch", "PromptBatch", "Rollout"]

def __getattr__(name: str) -> Any:
    """The callbacks' old import path (``gspo_lightning.rollout.GroupSampler``), resolved on first use."""
    if name in ("GroupSampler", "HeldOutEvaluation"):
        import gspo_lightning.sampling as sampling

        return getattr(sampling, name)
    raise AttributeError(f"module 'gspo_lightning.rollout' has no attribute {name!r}")

"""Callbacks around the rollout: export, sample completions, pre-emption checkpoints, non-finite step guard."""

from gspo_lightning.callbacks.completions import LogCompletions
from gspo_lightning.callbacks.export import ExportPolicy
from gspo_lightning.callbacks.nonfinite import NonFiniteGuard
from gspo_lightning.callbacks.preemption import CheckpointOnPreemption

__all__ = ["CheckpointOnPreemption", "ExportPolicy", "LogCompletions", "NonFiniteGuard"]

"""Callbacks that are not part of the rollout: exporting the trained policy."""

from gspo_lightning.callbacks.export import ExportPolicy

__all__ = ["ExportPolicy"]

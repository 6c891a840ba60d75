"""CheckpointOnPreemption: SIGTERM (a scheduler's pre-emption notice) writes a checkpoint before exiting."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from gspo_lightning.callbacks.emergency import save_emergency_checkpoint


class CheckpointOnPreemption(Callback):
    """On SIGTERM (and, under the command line, a first Ctrl-C), finish the current optimizer step, save ``last.ckpt``
    and exit.

    Lightning notes the signal and stops after the step in flight (on every rank); this callback then saves the
    complete state (weights, optimizer, data position, sampler round, random generators) where
    ``--ckpt_path last`` resumes from it.

    Args:
        enabled: set false to exit on SIGTERM without writing a checkpoint.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.saved_to: str | None = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.enabled and isinstance(exception, SIGTERMException):
            self.saved_to = save_emergency_checkpoint(trainer, "last")
            rank_zero_warn(
                f"stopping at step {trainer.global_step}: checkpoint saved to {self.saved_to}; resume with "
                "--ckpt_path last"
            )

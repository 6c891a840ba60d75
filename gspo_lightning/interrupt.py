"""StopOnInterrupt: Ctrl-C stops a run the way a scheduler's pre-emption does, with a checkpoint to resume from.

Lightning's own Ctrl-C handling stops wherever the interrupt lands (mid-rollout, mid-backward) and saves nothing.
During training this callback turns the first Ctrl-C into the pre-emption path instead: Lightning finishes the
optimizer step in flight and stops, and :class:`~gspo_lightning.callbacks.CheckpointOnPreemption` saves
``last.ckpt`` where ``--ckpt_path last`` resumes from it. A second Ctrl-C stops at once, without one. The command
line registers it (a script of the user's keeps its own Ctrl-C); it then prints where the run stopped and the
command that resumes it, and exits with status 130 (128 + SIGINT), as a shell does for a job stopped by Ctrl-C.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

STOPPED_BY_CTRL_C = 130
"""The exit status of a run stopped by Ctrl-C."""


class StopOnInterrupt(Callback):
    """During training, Ctrl-C (SIGINT) stops after the optimizer step in flight, through Lightning's SIGTERM path.

    ``interrupted`` tells whether it did. Outside training (setup, the warm start, the final export) Ctrl-C keeps
    its usual meaning.
    """

    def __init__(self) -> None:
        self.interrupted = False
        self._previous: Any = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if threading.current_thread() is threading.main_thread():  # only the main thread may set a handler
            self._previous = signal.signal(signal.SIGINT, self._on_interrupt)

    def _on_interrupt(self, signum: int, frame: FrameType | None) -> None:
        self.interrupted = True
        self._restore()  # a second Ctrl-C: stop now
        print(
            "\nCtrl-C: stopping after the optimizer step in flight and saving a checkpoint "
            "(Ctrl-C again: stop at once, without one)",
            file=sys.stderr,
            flush=True,
        )
        # Lightning's pre-emption handler, registered for the fit: it stops every rank at the same step's end
        os.kill(os.getpid(), signal.SIGTERM)

    def _restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()

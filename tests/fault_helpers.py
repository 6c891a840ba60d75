"""Test-only pieces named in configs by class_path: process killers, slow steps and a reward that always varies."""

from __future__ import annotations

import os
import signal
import time

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from gspo_lightning.engines import VLLMEngine


class KillAtStep(Callback):
    """SIGKILLs its own process at the start of optimizer step ``step``: a crash with no chance to clean up."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def length_reward(prompts, completions, **columns) -> list[float]:
    """Longer completions score higher: a learning signal even for an untrained policy."""
    return [len(c) / 8 for c in completions]


class TermAtStep(KillAtStep):
    """Sends SIGTERM to its own process at the start of optimizer step ``step``: a scheduler's pre-emption."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class FailingVLLMEngine(VLLMEngine):
    """vLLM, built and synced as usual, whose first sampling call fails: a run's real error."""

    def sample(self, *args, **kwargs):
        raise RuntimeError("the engine failed while sampling")


class InterruptAtStep(KillAtStep):
    """Sends SIGINT to its own process at the start of optimizer step ``step``: a user's Ctrl-C."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGINT)


class SlowSteps(Callback):
    """Sleeps ``seconds`` after every optimizer step: training that takes longer than the sampling it overlaps,
    whatever the machine's load (a sleep is not slowed by busy cores)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        time.sleep(self.seconds)

"""The context sampling and scoring run in, so that they see the model exactly as ``training_step`` does."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy


def parameters_are_sharded(trainer: pl.Trainer) -> bool:
    """Sharded strategies run collectives inside ``generate``: every rank must keep stepping (synced_gpus)."""
    return isinstance(trainer.strategy, FSDPStrategy | ModelParallelStrategy) and trainer.world_size > 1


@contextmanager
def inference_context(trainer: pl.Trainer) -> Iterator[None]:
    """No autograd, and the precision context of ``training_step`` (Lightning does not enter it in hooks)."""
    with torch.no_grad(), trainer.precision_plugin.forward_context():
        yield

"""The context sampling and scoring run in, so that they see the model exactly as ``training_step`` does."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def parameters_are_sharded(trainer: pl.Trainer) -> bool:
    """Sharded strategies run collectives inside ``generate``: every rank must keep stepping (synced_gpus)."""
    return isinstance(trainer.strategy, FSDPStrategy | ModelParallelStrategy) and trainer.world_size > 1


@contextmanager
def inference_context(trainer: pl.Trainer) -> Iterator[None]:
    """No autograd, the precision context of ``training_step`` (Lightning does not enter it in hooks), and,
    under FSDP1, the root unit's parameters gathered: outside the wrapped root's forward they are flat shards,
    and the decoder layers (their own units) gather theirs as they run."""
    with ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        if isinstance(trainer.strategy, FSDPStrategy) and isinstance(trainer.strategy.model, FSDP):
            stack.enter_context(FSDP.summon_full_params(trainer.strategy.model, recurse=False, writeback=False))
        stack.enter_context(trainer.precision_plugin.forward_context())
        yield

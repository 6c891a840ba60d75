"""Where a run that must stop now writes its checkpoint."""

from __future__ import annotations

import os

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint


def save_emergency_checkpoint(trainer: pl.Trainer, name: str) -> str:
    """Save the full training state to ``<checkpoint dir>/<name>.ckpt`` (all ranks must call it); return the path.

    The checkpoint directory is the ``ModelCheckpoint``'s, so ``--ckpt_path last`` finds a checkpoint named
    ``last``; without one it is ``<default_root_dir>/checkpoints``.
    """
    callback = trainer.checkpoint_callback
    directory = callback.dirpath if isinstance(callback, ModelCheckpoint) and callback.dirpath else None
    directory = directory or os.path.join(trainer.default_root_dir, "checkpoints")
    path = os.path.join(directory, f"{name}.ckpt")
    if isinstance(callback, ModelCheckpoint) and name == "last":
        # Its own last checkpoint, as the callback's state saved in it says: after a resume it overwrites this
        # file, instead of writing last-v1.ckpt beside it, which a later --ckpt_path last would not find.
        callback.last_model_path = path
    trainer.save_checkpoint(path)
    return path

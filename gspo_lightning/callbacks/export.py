"""ExportPolicy: write the trained policy and tokenizer with ``save_pretrained`` when training ends."""

from __future__ import annotations

import os

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback


class ExportPolicy(Callback):
    """Saves the policy and tokenizer so that ``AutoModelForCausalLM.from_pretrained(dirpath)`` loads them.

    Args:
        dirpath: where to write; default ``<trainer.log_dir>/hf_policy`` (or ``<default_root_dir>/hf_policy``).
        enabled: set false to skip the export.
    """

    def __init__(self, dirpath: str | None = None, enabled: bool = True) -> None:
        self.dirpath = dirpath
        self.enabled = enabled
        self.exported_to: str | None = None

    def resolve_dirpath(self, trainer: pl.Trainer) -> str:
        if self.dirpath is not None:
            return self.dirpath
        return os.path.join(trainer.log_dir or trainer.default_root_dir, "hf_policy")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.enabled:
            return
        path = self.resolve_dirpath(trainer)
        if trainer.is_global_zero:
            pl_module.policy.save_pretrained(path)
            pl_module.tokenizer.save_pretrained(path)
        trainer.strategy.barrier("export_policy")
        self.exported_to = path

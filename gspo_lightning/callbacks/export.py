"""ExportPolicy: write the trained policy and tokenizer with ``save_pretrained`` when training ends.

Under a sharded strategy (FSDP1, FSDP2) every rank holds a shard: the full state dict is gathered to rank 0's
CPU (a collective every rank joins), loaded into a fresh, unsharded copy of the model, and saved from there.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from gspo_lightning.strategies import parameters_are_sharded

_POLICY_PREFIX = "policy."


def gather_policy_state_dict(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, torch.Tensor]:
    """The policy's full state dict on rank 0's CPU (empty on other ranks); every rank must call it."""
    # Offloading tensors that already live on the CPU crashes FSDP1 (seen with gloo): only offload from devices.
    on_device = trainer.strategy.root_device.type != "cpu"
    options = StateDictOptions(full_state_dict=True, cpu_offload=on_device)
    full = get_model_state_dict(trainer.strategy.model, options=options)
    if not on_device and not trainer.is_global_zero:
        full = {}  # without offloading every rank receives the full dict; only rank 0 keeps it
    return {key[len(_POLICY_PREFIX) :]: value for key, value in full.items() if key.startswith(_POLICY_PREFIX)}


def unsharded_copy(pl_module: pl.LightningModule, state_dict: dict[str, torch.Tensor]) -> nn.Module:
    """A plain, unsharded copy of the policy holding ``state_dict``.

    Built by the module's policy loader when it has one, so wrappers such as a LoRA adapter come back with the
    same structure (and ``model_for_export`` applies); otherwise from the policy's config on the meta device.
    """
    policy = pl_module.policy
    loader = getattr(pl_module, "policy_loader", None)
    if loader is not None:
        model = loader.load_model(pl_module.tokenizer)
        model.load_state_dict(state_dict, strict=True)
        return model
    with torch.device("meta"):
        model = type(policy)(policy.config)
    model.load_state_dict(state_dict, strict=False, assign=True)
    model.tie_weights()
    missing = [name for name, tensor in model.state_dict().items() if tensor.is_meta]
    if missing:
        raise RuntimeError(f"the gathered policy state lacks {len(missing)} tensors, e.g. {missing[:3]}")
    model.generation_config = policy.generation_config
    return model


class ExportPolicy(Callback):
    """Saves the policy and tokenizer so that ``AutoModelForCausalLM.from_pretrained(dirpath)`` loads them.

    What is saved is ``policy_loader.model_for_export(policy)`` when the module's loader defines it (e.g. a LoRA
    adapter alone), else the policy. Sharded policies are gathered to rank 0 first.

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
        model = self._model_to_save(trainer, pl_module)
        if trainer.is_global_zero:
            model.save_pretrained(path)
            pl_module.tokenizer.save_pretrained(path)
        trainer.strategy.barrier("export_policy")
        self.exported_to = path

    @staticmethod
    def _model_to_save(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
        policy = pl_module.policy
        if parameters_are_sharded(trainer):
            state_dict = gather_policy_state_dict(trainer, pl_module)  # collective: every rank
            if not trainer.is_global_zero:
                return None
            policy = unsharded_copy(pl_module, state_dict)
        loader = getattr(pl_module, "policy_loader", None)
        export = getattr(loader, "model_for_export", None)
        return export(policy) if callable(export) else policy

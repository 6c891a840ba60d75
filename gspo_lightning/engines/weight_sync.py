"""The trainer's current weights for an inference engine: full tensors under Hugging Face names, one decoder
layer at a time, LoRA adapters merged in (or, for an engine that loads adapters itself, the base weights and the
adapter apart: ``lora="base"`` / ``lora="adapter"``).

Under a sharded strategy every rank holds a shard, and every rank's engine needs the whole layer: the groups are
gathered collectively (FSDP2: each parameter's ``full_tensor()``; FSDP1: ``summon_full_params`` of the layer's
unit), so every rank must iterate all of :func:`policy_weight_groups`, in the same order. Memory stays bounded by
one decoder layer (or the embeddings and head) at a time, never the whole model on one device.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from typing import Literal

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor

from gspo_lightning.strategies import decoder_layer_classes

_WRAPPERS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
_PEFT_PREFIX = "base_model.model."

WeightGroup = list[tuple[str, Tensor]]
"""(Hugging Face parameter name, full tensor) pairs of one decoder layer, or of everything outside the layers."""
LoRAWeights = Literal["merged", "base", "adapter"]
"""What a LoRA policy's weights are taken as: the adapter merged into the base weights (every engine can load
those); the base weights alone; the active adapter's tensors alone, under the names peft saves them with."""


def hf_name(name: str) -> str:
    """A parameter's name in the Hugging Face checkpoint, without the wrappers training added (FSDP1, activation
    checkpointing, ``torch.compile``, peft's ``base_model.model.`` and ``base_layer``)."""
    name = ".".join(part for part in name.split(".") if part not in _WRAPPERS)
    name = name.removeprefix(_PEFT_PREFIX)
    return name.replace(".base_layer.", ".")


def policy_weight_groups(policy: nn.Module, fsdp1_root: nn.Module | None = None,
                         lora: LoRAWeights = "merged") -> Iterator[WeightGroup]:  # fmt: skip
    """The policy's weights: the embeddings, final norm and head, then one decoder layer at a time.

    Args:
        policy: the Hugging Face causal LM (possibly peft-wrapped, FSDP2-sharded, or inside an FSDP1 root).
        fsdp1_root: under FSDP1, the root unit (the strategy's wrapped model); None otherwise.
        lora: a LoRA policy's weights merged, its base alone or its adapter alone (see ``LoRAWeights``).
    Yields:
        groups of (name, tensor); a tensor may be the live parameter (do not keep it past the next group).
    """
    layers = _decoder_layers(policy)
    names = {id(module): name for name, module in policy.named_modules()}
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    # Tied weights under every name (the head's as well as the embeddings'): an engine may keep them apart.
    rest = [(name, p) for name, p in policy.named_parameters(remove_duplicate=False) if id(p) not in in_layers]
    with _gathered(fsdp1_root):  # first: FSDP1 initialises its root on the first gather
        yield _resolved_lora(policy, "", _full(rest, fsdp1_root is not None, lora), lora, skip=layers)
    parents = _parents(fsdp1_root) if fsdp1_root is not None else {}
    for layer in layers:
        unit = _enclosing_fsdp_unit(layer, parents) if fsdp1_root is not None else None
        with _gathered(unit):
            prefix = names[id(layer)]
            full = _full(layer.named_parameters(prefix=prefix), unit is not None, lora)
            yield _resolved_lora(layer, prefix, full, lora)


def _decoder_layers(policy: nn.Module) -> list[nn.Module]:
    try:
        classes = tuple(decoder_layer_classes(policy))
    except ValueError:  # no repeated layers declared: the whole model is one group
        return []
    return [module for module in policy.modules() if isinstance(module, classes)]


def _parents(root: nn.Module) -> dict[int, nn.Module]:
    return {id(child): module for module in root.modules() for child in module.children()}


def _enclosing_fsdp_unit(module: nn.Module, parents: dict[int, nn.Module]) -> nn.Module | None:
    current: nn.Module | None = module
    while current is not None and not isinstance(current, FSDP):
        current = parents.get(id(current))
    return current


def _gathered(unit: nn.Module | None):
    """FSDP1: the unit's own parameters gathered (not its nested units'), read-only."""
    if unit is None:
        return nullcontext()
    return FSDP.summon_full_params(unit, recurse=False, writeback=False)


def _full(named: Iterator[tuple[str, Tensor]] | list[tuple[str, Tensor]], copy: bool,
          lora: LoRAWeights = "merged") -> dict[str, Tensor]:  # fmt: skip
    """Full tensors: a DTensor (FSDP2) gathered; under FSDP1 a copy, since the gathered storage is freed when
    the unit reshards. For ``lora="adapter"`` only the adapters' (nothing else is gathered)."""
    full = {}
    for name, parameter in named:
        if lora == "adapter" and ".lora_" not in name:
            continue
        tensor = parameter.detach()
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        full[name] = tensor.clone() if copy else tensor
    return full


def _resolved_lora(module: nn.Module, prefix: str, full: dict[str, Tensor], lora: LoRAWeights,
                   skip: list[nn.Module] = ()) -> WeightGroup:  # fmt: skip
    """``full`` as ``lora`` asks: merged (see ``_merged_lora``); the base alone, names as in the Hugging Face
    checkpoint; the active adapters' tensors alone, named as peft saves them (``...q_proj.lora_A.weight``)."""
    if lora == "merged":
        return _merged_lora(module, prefix, full, skip)
    if lora == "base":
        return [(hf_name(name), tensor) for name, tensor in full.items() if ".lora_" not in name]
    active = {adapter for m in module.modules() if _is_lora_linear(m) for adapter in m.active_adapters}
    return [(adapter_name(name, adapter), tensor) for name, tensor in full.items() for adapter in active
            if f".lora_A.{adapter}." in name or f".lora_B.{adapter}." in name]  # fmt: skip


def adapter_name(name: str, adapter: str) -> str:
    """An adapter tensor's name as peft's ``save_pretrained`` writes it: wrappers and the adapter's name removed
    (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``)."""
    name = ".".join(part for part in name.split(".") if part not in _WRAPPERS)
    return name.replace(f".lora_A.{adapter}.", ".lora_A.").replace(f".lora_B.{adapter}.", ".lora_B.")


def _merged_lora(module: nn.Module, prefix: str, full: dict[str, Tensor], skip: list[nn.Module] = ()) -> WeightGroup:
    """``full`` with every LoRA adapter merged into its base weight (W + scaling * B @ A), adapter tensors dropped,
    names as in the Hugging Face checkpoint."""
    skipped = {id(m) for layer in skip for m in layer.modules()}
    for name, lora in module.named_modules(prefix=prefix):
        if id(lora) in skipped or not _is_lora_linear(lora):
            continue
        base = f"{name}.base_layer.weight"
        if base not in full:
            continue
        weight = full[base].float()
        for adapter in lora.active_adapters:
            if adapter not in lora.lora_A:
                continue
            down = full.pop(f"{name}.lora_A.{adapter}.weight").float()  # [r, in]
            up = full.pop(f"{name}.lora_B.{adapter}.weight").float()  # [out, r]
            weight = weight + lora.scaling[adapter] * (up @ down)  # [out, in]
        full[base] = weight.to(full[base].dtype)
    return [(hf_name(name), tensor) for name, tensor in full.items() if ".lora_" not in name]


def _is_lora_linear(module: nn.Module) -> bool:
    """A peft LoRA layer wrapping a linear base layer (``lora_A`` / ``lora_B`` / ``scaling`` / ``base_layer``)."""
    return all(hasattr(module, attribute) for attribute in ("lora_A", "lora_B", "scaling", "base_layer")) and (
        isinstance(getattr(module, "base_layer"), nn.Linear)
    )


@torch.no_grad()
def policy_state(policy: nn.Module, fsdp1_root: nn.Module | None = None,
                 lora: LoRAWeights = "merged") -> dict[str, Tensor]:  # fmt: skip
    """All of :func:`policy_weight_groups` in one dict, cloned (for tests and small models)."""
    groups = policy_weight_groups(policy, fsdp1_root, lora)
    return {name: tensor.clone() for group in groups for name, tensor in group}

"""LoRA policies synced as their adapter alone: vLLM serves the frozen base and loads each version's adapter.

A LoRA policy's base weights never change, so an engine that applies adapters itself needs the base once and then
only the adapter per version: megabytes instead of the whole model (``sampler.engine.lora_sync``). vLLM does this
with its own LoRA support (``--enable-lora``; ``/v1/load_lora_adapter`` with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``): each version is written as peft writes an adapter
(``adapter_config.json`` + ``adapter_model.safetensors``) and loaded under a name of its own, so no request and no
prefix-cache block of one version is served by another; the previous version's name is then unloaded.

vLLM applies a plain LoRA only: :func:`adapter_refusal` names what it cannot (DoRA, trained modules besides the
adapter, several active adapters). ``auto`` then syncs merged weights, as every engine can load them.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from torch import Tensor, nn

from gspo_lightning.validation import SettingError

LoRASync = Literal["auto", "adapter", "merged"]
LORA_SYNCS = ("auto", "adapter", "merged")
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks vLLM 0.32 accepts as ``--max-lora-rank`` (``vllm.config.lora.MaxLoRARanks``)."""


def active_adapter(policy: nn.Module) -> tuple[str, Any] | None:
    """A peft-wrapped policy's active adapter: its name and ``LoraConfig``; None for a policy without peft."""
    configs = getattr(policy, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None
    active = getattr(policy, "active_adapters", None) or [getattr(policy, "active_adapter", None)]
    names = [name for name in active if name in configs]
    return (names[0], configs[names[0]]) if len(names) == 1 else ("+".join(map(str, active)), None)


def _served_config(policy: nn.Module) -> Any:
    """The ``LoraConfig`` of a policy :func:`adapter_refusal` accepts."""
    adapter = active_adapter(policy)
    assert adapter is not None and adapter[1] is not None, "needs a policy whose adapter vLLM can serve"
    return adapter[1]


def adapter_refusal(policy: nn.Module) -> str | None:
    """Why vLLM cannot serve ``policy`` as its base plus an adapter (None: it can)."""
    adapter = active_adapter(policy)
    if adapter is None:
        return "the policy has no LoRA adapter (model.policy is not a LoRA loader)"
    name, config = adapter
    if config is None:
        return f"the policy has several active adapters ({name}); vLLM applies one per request"
    kind = getattr(config, "peft_type", "LORA")
    if str(getattr(kind, "value", kind)) != "LORA":
        return f"the adapter is {kind}, not LoRA"
    if getattr(config, "use_dora", False):
        return "the adapter uses DoRA, which vLLM does not apply"
    if getattr(config, "modules_to_save", None):
        return f"the adapter also trains whole modules (modules_to_save: {config.modules_to_save})"
    trained = [n for n, p in policy.named_parameters() if p.requires_grad and ".lora_" not in n]
    if trained:
        return f"parameters outside the adapter train too ({trained[0]}, ...), so the base changes"
    return None


def resolve_lora_sync(choice: str, policy: nn.Module, weight_transfer: str) -> bool:
    """Whether the policy's versions travel as adapters (``sampler.engine.lora_sync`` resolved for ``policy``):
    ``auto`` where vLLM can serve the adapter and ``weight_transfer`` leaves files to it; ``adapter`` insists.
    ``choice`` is one of ``LORA_SYNCS`` (the engine checks it when it is built)."""
    refusal = adapter_refusal(policy)
    if choice == "merged" or (choice == "auto" and (refusal is not None or weight_transfer in ("nccl", "ipc"))):
        return False
    if refusal is not None:
        raise SettingError(f"sampler.engine.lora_sync: adapter, but {refusal}; use lora_sync: merged (or auto)")
    if weight_transfer in ("nccl", "ipc"):
        raise SettingError(f"sampler.engine.lora_sync: adapter loads adapters from files (vLLM's LoRA loading), "
                           f"but weight_transfer is {weight_transfer}: use weight_transfer: auto or file, or "
                           "lora_sync: merged")  # fmt: skip
    return True


def max_lora_rank(config: Any) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that holds every rank of the adapter (``r`` and its
    ``rank_pattern``)."""
    rank = max([int(config.r), *map(int, (getattr(config, "rank_pattern", None) or {}).values())])
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise SettingError(f"model.policy: LoRA rank {rank} is over vLLM's largest ({VLLM_LORA_RANKS[-1]}); use "
                       "sampler.engine.lora_sync: merged")  # fmt: skip


def server_lora_flags(policy: nn.Module) -> tuple[dict[str, Any], dict[str, str]]:
    """The ``vllm serve`` arguments and environment for serving ``policy``'s adapter: LoRA on, one adapter per
    batch (and two in memory, the version being replaced and the next), loadable while the server runs."""
    rank = max_lora_rank(_served_config(policy))
    arguments = {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1, "max_cpu_loras": 2}
    return arguments, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}


def check_server_lora(info: dict[str, Any], url: str, policy: nn.Module) -> None:
    """Refuse, at fit start, a server (``/server_info?config_format=json`` said ``info``) that cannot load
    ``policy``'s adapters: LoRA off, a smaller ``--max-lora-rank``, or adapters not loadable while it runs."""
    wanted = max_lora_rank(_served_config(policy))
    lora = (info.get("vllm_config") or {}).get("lora_config") or {}
    fix = "or set sampler.engine.lora_sync: merged"
    if not lora:
        raise SettingError(f"vLLM server {url} has LoRA off, and sampler.engine.lora_sync syncs the policy's "
                           f"adapter: start it with --enable-lora --max-lora-rank {wanted}, {fix}")  # fmt: skip
    if int(lora.get("max_lora_rank") or 0) < wanted:
        raise SettingError(f"vLLM server {url} has --max-lora-rank {lora.get('max_lora_rank')}, the policy's adapter "
                           f"rank {wanted}: start it with --max-lora-rank {wanted}, {fix}")  # fmt: skip
    updating = (info.get("vllm_env") or {}).get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    if str(updating).lower() not in ("true", "1"):
        raise SettingError(f"vLLM server {url} cannot load adapters while it runs: start it with "
                           f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, {fix}")  # fmt: skip


def write_adapter(path: str, policy: nn.Module, tensors: dict[str, Tensor]) -> None:
    """``tensors`` (named as peft saves them) as an adapter directory peft and vLLM load: ``adapter_config.json``
    (the policy's active ``LoraConfig``) and ``adapter_model.safetensors``."""
    from safetensors.torch import save_file

    _served_config(policy).save_pretrained(path)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})


def served_adapter_name(model: str, run: str, version: int) -> str:
    """The name version ``version`` of this run's adapter is loaded under: new for every version (vLLM keys its
    adapter cache and prefix-cache blocks by it), and never one another run loaded on a shared server."""
    return f"{model}-lora-{run}-{version}"

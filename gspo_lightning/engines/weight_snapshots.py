"""The trainer's weights as checkpoint files an engine outside this process reloads, and the probe that checks the
engine holds them.

Used by every engine that does not share the trainer's memory (``vllm_process``, ``vllm_server`` on CPUs): the
trainer writes each version once, as safetensors, to shared memory (``/dev/shm`` where there is one), and the
engine's loader reads it (vLLM's ``collective_rpc("reload_weights", weights_path=...)``). It costs a write and a
read of the weights per version: negligible for small models, and on GPUs a full copy through host memory. Engines
whose weights travel through vLLM's transfer engines instead (``vllm_server`` with NCCL or CUDA IPC,
:mod:`gspo_lightning.engines.weight_transfer`) take versions in memory: the full tensors copied on the trainer's
device, in the engine's dtype, sent when the version is loaded.

After every load a probe checks that the engine holds the trainer's weights: the log-probs of a fixed token
sequence (``PROBE_LENGTH`` tokens) under the engine's weights (its prompt log-probs) against the trainer's,
computed when the weights were written. A difference over the tolerance stops the run naming both figures: a
stale, partial or corrupted sync never samples a round.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import weakref
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from gspo_lightning.engines.lora_adapters import write_adapter
from gspo_lightning.engines.vllm_options import architecture, base_model
from gspo_lightning.engines.weight_sync import LoRAWeights, policy_weight_groups
from gspo_lightning.logprobs import response_logprobs
from gspo_lightning.strategies import fsdp1_root, inference_context
from gspo_lightning.validation import require

PROBE_LENGTH = 32
"""Tokens of the sequence whose log-probs check each sync."""

DEFAULT_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.25, "float16": 0.1}
"""Largest |log-prob difference| per probe token accepted between engine and trainer, by the engine's dtype: the
kernels' own disagreement is ~1e-5 in float32 on CPU; a sync that went wrong moves log-probs by far more."""


@dataclass
class WeightSnapshot:
    """One version of the trainer's weights, written for the engine.

    Attributes:
        step: the trainer's global step when it was taken.
        path: the directory holding ``config.json`` and ``model.safetensors`` (an adapter: ``adapter_config.json``
            and ``adapter_model.safetensors``); None for a version in memory.
        probe_logprobs: [PROBE_LENGTH - 1] float32, the trainer's log-probs of the probe's tokens (for the base
            of a LoRA policy: with the adapter off).
        nbytes: bytes of the tensors written (or held).
        tensors: a version in memory: full tensors under Hugging Face names, on the trainer's device; else None.
        lora: what it holds of a LoRA policy (``merged`` for any other policy).
    """

    step: int
    path: str | None
    probe_logprobs: Tensor
    nbytes: int = 0
    tensors: dict[str, Tensor] | None = None
    lora: LoRAWeights = "merged"
    _finalizer: Any = field(default=None, repr=False)


class WeightSnapshots:
    """Writes the trainer's weight versions and checks an engine against them (an engine composes one).

    Args:
        snapshot_dir: where snapshots are written (null: ``/dev/shm`` when it exists, else the temp dir).
        tolerance: the probe's largest accepted |log-prob difference| (null: by the engine's dtype).
        setting: the setting ``snapshot_dir`` and ``tolerance`` came from, for errors.
    """

    def __init__(self, snapshot_dir: str | None, tolerance: float | None, setting: str = "sampler.engine") -> None:
        require(
            tolerance is None or tolerance > 0,
            f"{setting}.sync_check_tolerance must be > 0 or null, got {tolerance!r}",
        )
        require(
            snapshot_dir is None or os.path.isdir(snapshot_dir),
            f"{setting}.snapshot_dir must be an existing directory or null, got {snapshot_dir!r}",
        )
        self.directory = snapshot_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.tolerance = tolerance
        self.setting = setting
        self.engine_dtype = "float32"
        self.probe: Tensor | None = None  # [PROBE_LENGTH] int64, set by setup
        self._fsdp1: nn.Module | None = None
        self._paths: list[str] = []  # every one written, removed by close at the latest

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, engine_dtype: str) -> None:
        """Once, at fit start: the probe for this policy's vocabulary and the strategy's sharding."""
        self._fsdp1 = fsdp1_root(trainer)
        self.engine_dtype = engine_dtype
        self.probe = probe_tokens(base_model(pl_module.policy).config.vocab_size, len(pl_module.tokenizer))

    @torch.no_grad()
    def take(self, trainer: pl.Trainer, pl_module: pl.LightningModule, in_memory: bool = False,
             lora: LoRAWeights = "merged") -> WeightSnapshot:  # fmt: skip
        """The trainer's current weights, written (``in_memory``: copied on the trainer's device, in the engine's
        dtype), with the trainer's probe log-probs; of a LoRA policy, ``lora`` says what (see ``LoRAWeights``).
        Every training rank calls this at the same point (a sharded policy is gathered one layer at a time)."""
        if in_memory:
            dtype = getattr(torch, self.engine_dtype, None) if self.engine_dtype != "auto" else None
            tensors = {name: tensor.detach().to(dtype=dtype, copy=True)
                       for group in policy_weight_groups(pl_module.policy, self._fsdp1) for name, tensor in group}
            return WeightSnapshot(trainer.global_step, None, self._probe(trainer, pl_module), _bytes(tensors), tensors)
        path = tempfile.mkdtemp(prefix="gspo_lightning_weights_", dir=self.directory)
        self._paths = [p for p in self._paths if os.path.exists(p)] + [path]
        try:
            tensors = {}
            for group in policy_weight_groups(pl_module.policy, self._fsdp1, lora):
                for name, tensor in group:  # copied: a group's tensors may be live parameters or freed shards
                    tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()
            nbytes = _bytes(tensors)
            if lora == "adapter":
                write_adapter(path, pl_module.policy, tensors)
            else:
                write_checkpoint(path, base_model(pl_module.policy), tensors)
            del tensors
            expected = self._probe(trainer, pl_module, adapter_off=lora == "base")
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        snapshot = WeightSnapshot(trainer.global_step, path, expected, nbytes, lora=lora)
        snapshot._finalizer = weakref.finalize(snapshot, shutil.rmtree, path, True)
        return snapshot

    def _probe(self, trainer: pl.Trainer, pl_module: pl.LightningModule, adapter_off: bool = False) -> Tensor:
        policy = pl_module.policy
        with inference_context(trainer), policy.disable_adapter() if adapter_off else nullcontext():
            return probe_logprobs(policy, self.probe_ids(), pl_module.device)  # [PROBE_LENGTH - 1]

    def check(self, snapshot: WeightSnapshot, engine_logprobs: Tensor, where: str = "the engine") -> None:
        """Raise unless ``engine_logprobs`` [PROBE_LENGTH - 1] (the engine's, of the probe) are the trainer's."""
        difference = float((engine_logprobs - snapshot.probe_logprobs).abs().max())
        tolerance = self.tolerance or DEFAULT_TOLERANCE.get(self.engine_dtype, 0.25)
        if not difference <= tolerance:  # NaN fails too
            raise RuntimeError(
                f"weight sync check failed at step {snapshot.step}: {where}'s log-probs of the probe sequence differ "
                f"from the trainer's by up to {difference:.3g} ({self.setting}.sync_check_tolerance: "
                f"{tolerance:g}); {where} does not hold the trainer's weights, so no round is sampled with them"
            )

    def probe_ids(self) -> Tensor:
        if self.probe is None:
            raise RuntimeError("the engine's setup must run before its weights are synced")
        return self.probe

    def close(self) -> None:
        """Remove every snapshot written (never raises)."""
        for path in self._paths:
            shutil.rmtree(path, ignore_errors=True)
        self._paths = []


def _bytes(tensors: dict[str, Tensor]) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())


def write_checkpoint(path: str, model: nn.Module, tensors: dict[str, Tensor]) -> None:
    """A Hugging Face checkpoint directory of ``tensors`` (config.json naming the architecture, one safetensors)."""
    from safetensors.torch import save_file

    config = model.config.to_dict()
    config["architectures"] = [architecture(model)]
    with open(os.path.join(path, "config.json"), "w") as handle:
        json.dump(config, handle)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def probe_tokens(vocab_size: int, tokenizer_size: int) -> Tensor:
    """[PROBE_LENGTH] int64: a fixed sequence of token ids both vocabularies have (a seeded draw)."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, min(vocab_size, tokenizer_size), (PROBE_LENGTH,), generator=generator)


def probe_logprobs(policy: nn.Module, probe: Tensor, device: torch.device) -> Tensor:
    """[PROBE_LENGTH - 1] float32 on the CPU: the policy's log-probs (temperature 1) of the probe's tokens 1..."""
    ids = probe[None].to(device)  # [1, T]
    return response_logprobs(policy, ids, torch.ones_like(ids), ids.shape[1] - 1, 1.0)[0].float().cpu()


def model_directory(first: WeightSnapshot, tokenizer: Any) -> str:
    """A directory an engine is started from: the tokenizer and the first snapshot's ``config.json`` (vLLM reads a
    tokenizer's model config); the snapshots themselves come and go with the versions."""
    directory = tempfile.mkdtemp(prefix="gspo_lightning_vllm_")
    tokenizer.save_pretrained(directory)
    shutil.copy(os.path.join(first.path, "config.json"), directory)
    return directory

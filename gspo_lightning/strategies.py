"""Sharded training on Lightning's own strategies, set up for Hugging Face decoder models.

- :class:`DecoderLayerFSDP` is Lightning's ``FSDPStrategy`` (FSDP1) with the policy's decoder layers as the
  wrapping (and optional activation-checkpointing) unit, found from the model itself, so a config needs no
  Python class paths. It is a subclass, so it also runs on CPU (Lightning refuses the base class there).
- :class:`DecoderLayerFSDP2` is Lightning's ``ModelParallelStrategy`` with ``tensor_parallel_size=1``:
  pure FSDP2. ``GSPOModule.configure_model`` shards the policy with :func:`shard_policy` (each decoder layer,
  then the root) on the strategy's data-parallel mesh; a plain ``ModelParallelStrategy`` gets the defaults.

Both save sharded checkpoints by default (each rank writes its shard; resume with ``--ckpt_path``), and
``ExportPolicy`` gathers the full policy to rank 0 for ``save_pretrained``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from gspo_lightning.validation import SettingError

_DEFAULT_TIMEOUT = timedelta(minutes=30)


def decoder_layer_classes(model: nn.Module) -> set[type[nn.Module]]:
    """The classes of ``model``'s repeated decoder layers, from Hugging Face's ``_no_split_modules``.

    Raises ``ValueError`` when the model declares none or none of them occurs in it.
    """
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    # By any class in the MRO: FSDP2 turns each sharded layer's class into a subclass (FSDPQwen3DecoderLayer).
    classes = {type(m) for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)}
    if not classes:
        raise ValueError(
            f"cannot find the decoder layers of {type(model).__name__}: no module class named in its "
            f"_no_split_modules ({sorted(names)}) occurs in it; shard it yourself in configure_model"
        )
    return classes


def _is_decoder_layer(classes: set[type[nn.Module]]):
    return lambda module: isinstance(module, tuple(classes))


def shard_policy(
    policy: nn.Module,
    mesh: Any,
    reshard_after_forward: bool = True,
    activation_checkpointing: bool = False,
) -> nn.Module:
    """FSDP2-shard ``policy`` in place: each decoder layer is a unit, then the root (embeddings, norm, head).

    Args:
        policy: the Hugging Face causal LM.
        mesh: the data-parallel ``DeviceMesh`` to shard over.
        reshard_after_forward: free gathered parameters after each layer's forward (less memory, more traffic).
        activation_checkpointing: recompute each decoder layer's activations in backward (non-reentrant);
            works in eval mode, unlike ``transformers``' own gradient checkpointing.
    """
    from torch.distributed.fsdp import fully_shard

    classes = decoder_layer_classes(policy)
    if activation_checkpointing:
        apply_activation_checkpointing(policy, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=_is_decoder_layer(classes))
    for module in list(policy.modules()):
        if isinstance(module, tuple(classes)):
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
    # The root unit must be a module whose forward every path calls: a peft wrapper's generate() goes straight
    # to the wrapped model, skipping the wrapper's forward (and so the hooks that gather the root's shards).
    root = policy.get_base_model() if callable(getattr(policy, "get_base_model", None)) else policy
    fully_shard(root, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return policy


class DecoderLayerFSDP(FSDPStrategy):
    """Lightning's ``FSDPStrategy`` (FSDP1) wrapping each decoder layer of the policy as one FSDP unit.

    Args:
        activation_checkpointing: recompute each decoder layer's activations in backward.
        sharding_strategy: ``FULL_SHARD`` (ZeRO-3), ``SHARD_GRAD_OP`` (ZeRO-2), ``NO_SHARD`` or ``HYBRID_SHARD``
            (shard inside a node, replicate across nodes).
        state_dict_type: ``sharded`` (each rank writes its shard: fast, scales) or ``full`` (one file,
            gathered on rank 0).
        cpu_offload: keep parameters and gradients on the CPU between uses.
        limit_all_gathers: rate-limit all-gathers to bound memory peaks.
        process_group_backend: ``nccl`` / ``gloo``; default from the accelerator.
        timeout: timeout of collective operations.
        kwargs: further ``FullyShardedDataParallel`` arguments (``use_orig_params`` is True by default so that
            frozen and trainable parameters, e.g. LoRA, can share a unit).
    """

    def __init__(
        self,
        activation_checkpointing: bool = False,
        sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"] = "FULL_SHARD",
        state_dict_type: Literal["full", "sharded"] = "sharded",
        cpu_offload: bool = False,
        limit_all_gathers: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = _DEFAULT_TIMEOUT,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("use_orig_params", True)
        super().__init__(
            sharding_strategy=sharding_strategy,
            state_dict_type=state_dict_type,
            cpu_offload=cpu_offload,
            limit_all_gathers=limit_all_gathers,
            process_group_backend=process_group_backend,
            timeout=timeout,
            **kwargs,
        )
        self.activation_checkpointing = activation_checkpointing

    def _setup_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if any(isinstance(module, FullyShardedDataParallel) for module in model.modules()):
            return super()._setup_model(model)  # wrapped by the user in configure_model
        classes = decoder_layer_classes(model)
        if self.activation_checkpointing:
            self._activation_checkpointing_kwargs = {"check_fn": _is_decoder_layer(classes)}
        # Wrapped here rather than by the base class, which passes the device index: None on CPU, which FSDP
        # then refuses; the device itself works on both.
        wrapped = FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=self.root_device,
            **{"auto_wrap_policy": ModuleWrapPolicy(classes), **self.kwargs},
        )
        return super()._setup_model(wrapped)  # moves metrics, applies activation checkpointing


class DecoderLayerFSDP2(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` as pure FSDP2 (``tensor_parallel_size=1``) for the policy.

    Args:
        data_parallel_size: ranks to shard over; ``auto`` uses every device of every node.
        reshard_after_forward: free gathered parameters after each layer's forward (less memory, more traffic).
        activation_checkpointing: recompute each decoder layer's activations in backward.
        save_distributed_checkpoint: sharded checkpoints (each rank its shard); False gathers one file.
        process_group_backend: ``nccl`` / ``gloo``; default from the accelerator.
        timeout: timeout of collective operations.
    """

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        reshard_after_forward: bool = True,
        activation_checkpointing: bool = False,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = _DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.reshard_after_forward = reshard_after_forward
        self.activation_checkpointing = activation_checkpointing

    def setup_environment(self) -> None:
        # The base class reads "auto" as one replica per node (tensor parallelism inside it); with tensor
        # parallelism fixed at 1, every process is a data-parallel replica.
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()


def shard_for_strategy(
    policy: nn.Module, strategy: Any, device_mesh: Any, activation_checkpointing: bool = False
) -> nn.Module:
    """Shard ``policy`` as ``strategy`` needs inside ``configure_model`` (only FSDP2 shards there), with
    activation checkpointing of its decoder layers when asked for here or by the strategy.

    Checkpointing wraps each decoder layer in torch's non-reentrant ``checkpoint_wrapper``, which recomputes in
    any mode: Hugging Face's own gradient checkpointing only acts in training mode, and the policy stays in eval
    mode (dropout off). Under FSDP1 the strategy applies the same wrapper after wrapping its units.
    """
    if isinstance(strategy, ModelParallelStrategy):
        return shard_policy(
            policy,
            device_mesh["data_parallel"],
            reshard_after_forward=getattr(strategy, "reshard_after_forward", True),
            activation_checkpointing=activation_checkpointing or getattr(strategy, "activation_checkpointing", False),
        )
    if activation_checkpointing and isinstance(strategy, DecoderLayerFSDP):
        strategy.activation_checkpointing = True  # applied when it wraps the model, after configure_model
    elif activation_checkpointing and isinstance(strategy, FSDPStrategy):
        raise ValueError(
            "model.activation_checkpointing=true under a plain FSDPStrategy: use gspo_lightning.DecoderLayerFSDP "
            "(which applies it to the decoder layers) or FSDPStrategy(activation_checkpointing_policy=...)"
        )
    elif activation_checkpointing:  # single device, DDP: the same wrapper, applied here
        apply_activation_checkpointing(
            policy, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=_is_decoder_layer(decoder_layer_classes(policy))
        )
    return policy


def hands_over_hf_checkpointing(policy: nn.Module) -> bool:
    """Whether the loaded policy has Hugging Face's gradient checkpointing on, which only acts in training mode:
    it is switched off, and the module's own (``activation_checkpointing``) used instead."""
    # transformers >= 5.x names it activation checkpointing; earlier versions gradient checkpointing
    current = hasattr(policy, "activation_checkpointing_enable")
    if not (policy.is_activation_checkpointing if current else getattr(policy, "is_gradient_checkpointing", False)):
        return False
    disable = getattr(policy, "activation_checkpointing_disable", None) or policy.gradient_checkpointing_disable
    disable()
    rank_zero_warn(
        "the policy came with Hugging Face gradient checkpointing enabled, which does nothing in eval mode (where "
        "the policy stays, so that dropout is off): using model.activation_checkpointing instead"
    )
    return True


def fsdp1_root(trainer: pl.Trainer) -> nn.Module | None:
    """Under FSDP1, the root unit Lightning wrapped the module in (the weight sync gathers its parameters);
    None under every other strategy."""
    model = getattr(trainer.strategy, "model", None)
    return model if isinstance(model, FSDP) else None


def refuse_micro_batches_sharded(micro_batch_tokens: int | None, strategy: Any) -> None:
    """Token-budget micro-batches are not built for FSDP yet: every rank would have to run the same number of
    sharded forwards (each gathers parameters), and backward recomputes them outside FSDP's own order."""
    if micro_batch_tokens is not None and isinstance(strategy, FSDPStrategy | ModelParallelStrategy):
        raise SettingError(
            f"model.micro_batch_tokens={micro_batch_tokens} is not supported under {type(strategy).__name__} yet: "
            "use it on one device or with DDP, or bound memory with model.activation_checkpointing: true; "
            "set model.micro_batch_tokens: null"
        )


def is_fsdp1(strategy: Any) -> bool:
    """FSDP1 needs special handling in hooks: full parameters for ``generate``, its own gradient clipping."""
    return isinstance(strategy, FSDPStrategy)


__all__ = [
    "DecoderLayerFSDP",
    "DecoderLayerFSDP2",
    "decoder_layer_classes",
    "is_fsdp1",
    "shard_for_strategy",
    "shard_policy",
]


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

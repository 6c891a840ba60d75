"""The total gradient norm of an optimizer step, computed once and shared.

``NonFiniteGuard`` needs it to tell a finite gradient from a NaN/inf one; norm clipping needs the same figure
to scale the gradients. Computing it twice reads every gradient twice (a third of a millisecond per step on
the tiny quick-start model, more on a real one). Both go through :func:`step_gradient_norm`, which caches the
norm on the trainer for the step and the exact gradient tensors it was computed from.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import Tensor

_CACHE = "_gspo_gradient_norm"  # trainer attribute: the _NormOf of the last computed norm


@dataclass
class _NormOf:
    """A norm and what it was computed from; weak references, so the cache keeps no gradient alive."""

    step: int
    optimizer: int
    gradients: list[weakref.ref]
    versions: list[int]
    norm: Tensor

    def matches(self, step: int, optimizer: int, gradients: list[Tensor]) -> bool:
        return (
            (self.step, self.optimizer, len(self.gradients)) == (step, optimizer, len(gradients))
            and all(ref() is g for ref, g in zip(self.gradients, gradients))
            and self.versions == [g._version for g in gradients]
        )


def optimizer_parameters(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """Every parameter of ``optimizer``, group by group: the order Lightning's clipping reads them in."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def optimizer_gradients(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """Every gradient of ``optimizer``'s parameters, in the order ``clip_grad_norm_`` reads them."""
    return [p.grad for p in optimizer_parameters(optimizer) if p.grad is not None]


def step_gradient_norm(trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> Tensor:
    """``torch.nn.utils.get_total_norm`` (2-norm) of ``optimizer``'s gradients, reused within an optimizer step.

    The cached norm is reused only for the same global step, optimizer and gradient tensors at the same version
    counters: a gradient changed in place (a callback rescaling it), replaced or dropped gives a fresh norm.
    """
    gradients = optimizer_gradients(optimizer)
    cached = getattr(trainer, _CACHE, None)
    if cached is not None and cached.matches(trainer.global_step, id(optimizer), gradients):
        return cached.norm
    norm = torch.nn.utils.get_total_norm(gradients)
    references = [weakref.ref(g) for g in gradients]
    versions = [g._version for g in gradients]
    setattr(trainer, _CACHE, _NormOf(trainer.global_step, id(optimizer), references, versions, norm))
    return norm


def clip_by_step_norm(trainer: pl.Trainer, optimizer: torch.optim.Optimizer, max_norm: float) -> None:
    """``clip_grad_norm_(params, max_norm)`` with the step's shared norm: the same gradients, bit for bit."""
    norm = step_gradient_norm(trainer, optimizer)
    torch.nn.utils.clip_grads_with_norm_(optimizer_parameters(optimizer), max_norm, norm)


def clips_with_plain_norm(trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> bool:
    """Whether Lightning's norm clipping would be plain ``clip_grad_norm_`` over ``optimizer``'s parameters, so that
    :func:`clip_by_step_norm` may stand in for it: the precision plugin keeps ``Precision``'s clipping (not
    FSDP1's or DeepSpeed's), and for mixed precision the optimizer does not unscale internally (Lightning refuses
    to clip those)."""
    plugin = type(trainer.precision_plugin)
    if plugin.clip_grad_by_norm is not Precision.clip_grad_by_norm:
        return False
    if plugin.clip_gradients is Precision.clip_gradients:
        return True
    fused = getattr(optimizer, "_step_supports_amp_scaling", False)
    return plugin.clip_gradients is MixedPrecision.clip_gradients and not fused

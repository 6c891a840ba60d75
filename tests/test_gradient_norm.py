"""One gradient norm per optimizer step, shared by NonFiniteGuard and norm clipping, equal to clip_grad_norm_'s."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import DeepSpeedPrecision, FSDPPrecision, MixedPrecision, Precision

import gspo_lightning.module as module_file
from gspo_lightning import GroupSampler, GSPOModule
from gspo_lightning.callbacks import NonFiniteGuard
from gspo_lightning.data import ArithmeticTask, PromptDataModule
from gspo_lightning.gradient_norm import clip_by_step_norm, clips_with_plain_norm, step_gradient_norm
from gspo_lightning.models import TinyQwen3
from tests.conftest import TINY
from tests.fault_helpers import length_reward


def _model_with_gradients(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model(torch.randn(5, 4)).square().sum().backward()
    return model, torch.optim.AdamW(model.parameters())


def _counting(monkeypatch) -> list[int]:
    calls, original = [], torch.nn.utils.get_total_norm
    monkeypatch.setattr(torch.nn.utils, "get_total_norm", lambda grads: calls.append(1) or original(grads))
    return calls


def test_the_norm_is_computed_once_and_equals_get_total_norm(monkeypatch):
    model, optimizer = _model_with_gradients()
    trainer = SimpleNamespace(global_step=3)
    calls = _counting(monkeypatch)
    first = step_gradient_norm(trainer, optimizer)
    assert step_gradient_norm(trainer, optimizer) is first and len(calls) == 1
    hand = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    torch.testing.assert_close(first, hand, rtol=1e-6, atol=0)


@pytest.mark.parametrize("change", ["in_place", "replaced", "dropped", "next_step"])
def test_a_changed_gradient_or_step_gives_a_fresh_norm(monkeypatch, change):
    model, optimizer = _model_with_gradients()
    trainer = SimpleNamespace(global_step=0)
    first = step_gradient_norm(trainer, optimizer)
    weight = model[0].weight
    if change == "in_place":
        weight.grad.mul_(2.0)  # a callback rescaling a gradient
    elif change == "replaced":
        weight.grad = weight.grad * 2.0
    elif change == "dropped":
        weight.grad = None
    else:
        trainer.global_step = 1
    calls = _counting(monkeypatch)
    second = step_gradient_norm(trainer, optimizer)
    assert len(calls) == 1
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    assert torch.equal(second, expected)
    assert change == "next_step" or not torch.equal(second, first)


def test_the_cache_keeps_no_gradient_alive():
    model, optimizer = _model_with_gradients()
    step_gradient_norm(SimpleNamespace(global_step=0), optimizer)
    gradient = weakref.ref(model[0].weight.grad)
    optimizer.zero_grad(set_to_none=True)
    assert gradient() is None  # only the parameter's .grad held it


def test_clipping_with_the_shared_norm_is_clip_grad_norm_bit_for_bit():
    shared, optimizer = _model_with_gradients()
    plain, _ = _model_with_gradients()
    trainer = SimpleNamespace(global_step=0)
    step_gradient_norm(trainer, optimizer)  # as NonFiniteGuard does first
    clip_by_step_norm(trainer, optimizer, max_norm=0.1)
    torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
    for a, b in zip(shared.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    assert torch.nn.utils.get_total_norm([p.grad for p in shared.parameters()]) < 0.1 + 1e-6


@pytest.mark.parametrize(
    "plugin, fused, plain",
    [
        (Precision(), False, True),
        (MixedPrecision("bf16-mixed", "cpu"), False, True),
        (MixedPrecision("bf16-mixed", "cpu"), True, False),  # Lightning refuses to clip a self-unscaling step
        (FSDPPrecision("32-true"), False, False),  # FSDP1: the wrapped root computes the norm across shards
        (DeepSpeedPrecision("32-true"), False, False),  # DeepSpeed clips inside its engine
    ],
)
def test_only_plain_norm_clipping_is_replaced(plugin, fused, plain):
    optimizer = SimpleNamespace(_step_supports_amp_scaling=fused)
    assert clips_with_plain_norm(SimpleNamespace(precision_plugin=plugin), optimizer) is plain


def _fit(tmp_path, monkeypatch, shared: bool) -> tuple[GSPOModule, list[int]]:
    if not shared:  # Lightning's own clip_gradients path, with its own norm
        monkeypatch.setattr(module_file, "clips_with_plain_norm", lambda trainer, optimizer: False)
    calls = _counting(monkeypatch)
    pl.seed_everything(0)
    module = GSPOModule(TinyQwen3(**TINY), lr=1e-3, max_new_tokens=4)
    data = PromptDataModule(
        ArithmeticTask(train_size=64, eval_size=8), "{question}=", prompts_per_rollout=2, minibatches_per_rollout=2
    )
    sampler = GroupSampler(rewards=[length_reward], group_size=4, num_minibatches=2, max_new_tokens=4)
    trainer = pl.Trainer(
        max_steps=4, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, default_root_dir=tmp_path, gradient_clip_val=1e-3,
        callbacks=[sampler, NonFiniteGuard()],
    )
    trainer.fit(module, data)
    return module, calls


def test_training_reads_the_gradients_once_per_step_and_clips_as_lightning_does(tmp_path, monkeypatch):
    shared, shared_calls = _fit(tmp_path / "shared", monkeypatch, shared=True)
    assert len(shared_calls) == 4  # the guard's; clipping reused it
    with monkeypatch.context() as patch:
        lightning_path, _ = _fit(tmp_path / "lightning", patch, shared=False)
    for a, b in zip(shared.policy.parameters(), lightning_path.policy.parameters(), strict=True):
        assert torch.equal(a, b)

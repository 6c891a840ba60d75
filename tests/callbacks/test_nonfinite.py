"""A NaN loss or gradient never reaches the weights; a run that keeps producing them stops with a checkpoint."""

from __future__ import annotations

import functools

import lightning.pytorch as pl
import pytest
import torch

from gspo_lightning import GroupSampler, GSPOModule
from gspo_lightning.callbacks import NonFiniteGuard
from gspo_lightning.data import ArithmeticTask, PromptDataModule
from gspo_lightning.models import TinyQwen3
from tests.conftest import TINY
from tests.fault_helpers import length_reward


class Poison(pl.Callback):
    """Makes the loss (via pi_old's log-probs) or a gradient NaN at the given optimizer steps."""

    def __init__(self, loss_steps=(), gradient_steps=()):
        self.loss_steps, self.gradient_steps = set(loss_steps), set(gradient_steps)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step in self.loss_steps:
            batch.minibatch.old_logprobs = torch.full_like(batch.minibatch.old_logprobs, float("nan"))

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step in self.gradient_steps:
            next(p for p in pl_module.policy.parameters() if p.grad is not None).grad.fill_(float("nan"))


class WeightWatcher(pl.Callback):
    """Records, per batch, whether the policy's weights changed."""

    def __init__(self):
        self.changed: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._before = torch.cat([p.detach().flatten().clone() for p in pl_module.policy.parameters()])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        after = torch.cat([p.detach().flatten() for p in pl_module.policy.parameters()])
        assert torch.isfinite(after).all()
        self.changed.append(not torch.equal(after, self._before))


def _fit(tmp_path, callbacks, batches):
    torch.manual_seed(0)
    module = GSPOModule(TinyQwen3(**TINY), optimizer=functools.partial(torch.optim.AdamW, lr=1e-3), max_new_tokens=4)
    data = PromptDataModule(ArithmeticTask(train_size=64, eval_size=8), "{question}=", prompts_per_rollout=2,
                            minibatches_per_rollout=2)
    sampler = GroupSampler(rewards=[length_reward], group_size=4, num_minibatches=2)
    trainer = pl.Trainer(
        max_steps=batches, limit_train_batches=batches, max_epochs=1, accelerator="cpu", logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        default_root_dir=tmp_path, callbacks=[sampler, *callbacks],
    )
    trainer.fit(module, data)
    return trainer


def test_bad_steps_are_skipped_and_counted(tmp_path):
    guard, watcher = NonFiniteGuard(max_consecutive_bad_steps=3), WeightWatcher()
    _fit(tmp_path, [Poison(loss_steps={1}, gradient_steps={3}), guard, watcher], batches=6)
    # Step 1: NaN loss (the module skips the update); step 3: NaN gradient. Neither moves a weight.
    assert watcher.changed == [True, False, True, False, True, True]
    assert guard.skipped_steps == 2 and guard.consecutive_bad_steps == 0


def test_the_module_skips_a_nonfinite_loss_step_without_the_guard(tmp_path):
    watcher = WeightWatcher()
    trainer = _fit(tmp_path, [Poison(loss_steps={1}), watcher], batches=3)
    assert watcher.changed == [True, False, True]
    assert trainer.callback_metrics["faults/nonfinite_loss"] == 0.0  # the last step's figure


def test_too_many_consecutive_bad_steps_stop_with_a_checkpoint(tmp_path):
    guard = NonFiniteGuard(max_consecutive_bad_steps=2)
    with pytest.raises(RuntimeError, match="2 consecutive steps had a non-finite loss or gradient"):
        _fit(tmp_path, [Poison(gradient_steps=set(range(10))), guard], batches=6)
    assert (tmp_path / "checkpoints/nonfinite-stop.ckpt").exists()


def test_max_consecutive_bad_steps_is_validated():
    with pytest.raises(ValueError, match="nonfinite.max_consecutive_bad_steps must be >= 1"):
        NonFiniteGuard(max_consecutive_bad_steps=0)

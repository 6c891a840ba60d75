"""The sampler callback in a LightningModule that is not ours: only the documented contract is used."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from gspo_lightning.logprobs import response_logprobs
from gspo_lightning.rewards import ExactAnswer
from gspo_lightning.rollout import GroupSampler, PromptBatch


class ReinforceModule(pl.LightningModule):
    """Someone else's module: plain REINFORCE with the group baseline, exposing `policy` and `tokenizer`."""

    def __init__(self, policy, tokenizer):
        super().__init__()
        self.policy = policy
        self.tokenizer = tokenizer
        self.seen: list[tuple[int, int, int]] = []

    def training_step(self, batch, batch_idx):
        mb = batch.minibatch
        logprobs = response_logprobs(self.policy, mb.input_ids, mb.attention_mask, mb.response_ids.shape[1])
        mask = mb.response_mask.float()
        self.seen.append((batch.rollout_index, batch.minibatch_index, len(mb)))
        return -(mb.advantages[:, None] * logprobs * mask).sum() / mask.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.policy.parameters(), lr=1e-2)


def _prompt_batches(rounds: int, k: int) -> list[PromptBatch]:
    prompts, answers = ["1+1=", "2+3="], ["2", "5"]
    return [
        PromptBatch(prompts, {"answer": answers}, rollout_index=r, minibatch_index=i, num_minibatches=k)
        for r in range(rounds)
        for i in range(k)
    ]


def _trainer(sampler: GroupSampler, steps: int) -> pl.Trainer:
    return pl.Trainer(
        max_steps=steps, accelerator="cpu", callbacks=[sampler], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )


def test_sampler_drives_a_foreign_module(policy, tokenizer):
    module = ReinforceModule(policy, tokenizer)
    sampler = GroupSampler(rewards=[ExactAnswer()], group_size=4, num_minibatches=2, max_new_tokens=4)
    calls = []
    original = policy.generate
    policy.generate = lambda *a, **k: calls.append(1) or original(*a, **k)
    loader = DataLoader(_prompt_batches(3, 2), batch_size=None, collate_fn=lambda b: b)
    _trainer(sampler, 6).fit(module, loader)
    assert module.seen == [(r, i, 4) for r in range(3) for i in range(2)]  # 2 prompts x 4 responses / 2
    assert len(calls) == 3  # one sampling pass per rollout round, not per step
    metrics = _trainer_metrics(module)
    for key in ("rollout/reward_mean", "rollout/zero_variance_frac", "rollout/truncated_frac", "time/generate_s"):
        assert key in metrics


def _trainer_metrics(module):
    return module.trainer.callback_metrics


def test_sampler_state_carries_a_partly_consumed_round(policy, tokenizer):
    sampler = GroupSampler(rewards=[ExactAnswer()], group_size=2, num_minibatches=2, max_new_tokens=3)
    module = ReinforceModule(policy, tokenizer)
    loader = DataLoader(_prompt_batches(1, 2)[:1], batch_size=None, collate_fn=lambda b: b)
    _trainer(sampler, 1).fit(module, loader)
    restored = GroupSampler(rewards=[ExactAnswer()], group_size=2, num_minibatches=2, max_new_tokens=3)
    restored.load_state_dict(sampler.state_dict())
    assert restored._rollout_index == 0
    for saved, loaded in zip(sampler._minibatches, restored._minibatches):
        assert torch.equal(saved.old_logprobs, loaded.old_logprobs)


def test_sampler_rejects_a_module_without_the_contract(policy, tokenizer):
    module = ReinforceModule(policy, tokenizer)
    module.tokenizer = None
    sampler = GroupSampler(rewards=[ExactAnswer()], group_size=2, num_minibatches=2, max_new_tokens=3)
    loader = DataLoader(_prompt_batches(1, 2), batch_size=None, collate_fn=lambda b: b)
    with pytest.raises(AttributeError, match="expose `tokenizer`"):
        _trainer(sampler, 1).fit(module, loader)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"group_size": 1}, "group_size must be >= 2"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"reward_weights": [1.0, 2.0]}, "reward_weights has 2 values for 1 rewards"),
    ],
)
def test_sampler_settings_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GroupSampler(rewards=[ExactAnswer()], **kwargs)

"""Skipped groups get advantages 0, are counted, and a batch without signal trains with loss exactly 0."""

from __future__ import annotations

import math

import pytest
import torch

from gspo_lightning.objectives import OBJECTIVE_PRESETS, group_advantages, objective_loss
from gspo_lightning.objectives.advantages import advantages_with_skips, skipped_responses
from gspo_lightning.rollout.stats import rollout_stats
from gspo_lightning.rollout.types import Rollout

G = 3


def _rollout(rewards: list[float], advantages: torch.Tensor, **fields) -> Rollout:
    n = len(rewards)
    return Rollout(
        prompt_ids=torch.ones(n, 2, dtype=torch.long),
        prompt_mask=torch.ones(n, 2, dtype=torch.long),
        response_ids=torch.ones(n, 4, dtype=torch.long),
        response_mask=torch.ones(n, 4, dtype=torch.long),
        rewards=torch.tensor(rewards),
        advantages=advantages,
        truncated=torch.zeros(n, dtype=torch.bool),
        **fields,
    )


def test_a_nan_reward_zeros_its_group_only():
    rewards = torch.tensor([0.0, 1.0, 2.0, 0.0, math.nan, 1.0, 3.0, 1.0, 2.0])  # [9], 3 groups
    skipped = skipped_responses(rewards, None, G)
    assert skipped.tolist() == [False] * 3 + [True] * 3 + [False] * 3
    advantages = advantages_with_skips(rewards, skipped, G, "group")
    assert advantages[3:6].tolist() == [0.0, 0.0, 0.0]
    kept = torch.cat([rewards[:3], rewards[6:]])
    torch.testing.assert_close(torch.cat([advantages[:3], advantages[6:]]), group_advantages(kept, G))
    stats = rollout_stats(_rollout(rewards.tolist(), advantages), G)
    assert stats["reward_errors"] == 1 and stats["groups_skipped"] == 1 and stats["no_signal"] == 0
    torch.testing.assert_close(stats["reward_mean"], rewards[~rewards.isnan()].mean())  # only the NaN left out


def test_batch_scale_ignores_skipped_groups():
    rewards = torch.tensor([0.0, 1.0, 2.0, 100.0, -100.0, 0.0])
    prompt_skipped = torch.tensor([False] * 3 + [True] * 3)
    skipped = skipped_responses(rewards, prompt_skipped, G)
    advantages = advantages_with_skips(rewards, skipped, G, "batch")
    torch.testing.assert_close(advantages[:3], group_advantages(rewards[:3], G, "batch"))
    assert advantages[3:].tolist() == [0.0, 0.0, 0.0]


def test_prompt_counts_and_no_signal():
    rewards = [1.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    cut = torch.tensor([True] * 3 + [False] * 3)
    skipped = skipped_responses(torch.tensor(rewards), cut, G)
    advantages = advantages_with_skips(torch.tensor(rewards), skipped, G, "group")
    stats = rollout_stats(_rollout(rewards, advantages, prompt_cut=cut, prompt_skipped=cut), G)
    assert stats["prompts_truncated"] == 1 and stats["prompts_skipped"] == 1 and stats["groups_skipped"] == 1
    assert stats["no_signal"] == 0  # the second group still varies
    flat = [1.0] * 6
    stats = rollout_stats(_rollout(flat, group_advantages(torch.tensor(flat), G)), G)
    assert stats["no_signal"] == 1 and stats["zero_variance_frac"] == 1
    assert stats["groups_skipped"] == 0 and stats["prompts_truncated"] == 0


def test_every_sample_failing_gives_nan_reward_figures_but_zero_advantages():
    rewards = torch.full((6,), math.nan)
    advantages = advantages_with_skips(rewards, skipped_responses(rewards, None, G), G, "batch")
    assert advantages.tolist() == [0.0] * 6
    stats = rollout_stats(_rollout(rewards.tolist(), advantages), G)
    assert stats["reward_errors"] == 6 and stats["groups_skipped"] == 2 and stats["no_signal"] == 1


@pytest.mark.parametrize("preset", sorted(OBJECTIVE_PRESETS))
def test_a_batch_without_signal_has_loss_exactly_zero(preset):
    spec = OBJECTIVE_PRESETS[preset]
    eps_low, eps_high = (3e-4, 4e-4) if spec.ratio.startswith("sequence") else (0.2, 0.27)
    torch.manual_seed(0)
    logprobs = (-torch.rand(6, 5)).requires_grad_()  # [N, T]
    old_logprobs = logprobs.detach() - 0.1 * torch.rand(6, 5)  # [N, T] off-policy: ratios away from 1
    mask = torch.tensor([[1] * 5, [1] * 3 + [0] * 2, [0] * 5] * 2)  # [N, T] an empty response included
    advantages = torch.zeros(6)  # [N] every group zero-variance or skipped
    loss, _ = objective_loss(spec, logprobs, old_logprobs, advantages, mask, eps_low, eps_high)
    assert loss.item() == 0.0 and not loss.isnan()
    loss.backward()
    assert torch.isfinite(logprobs.grad).all() and (logprobs.grad == 0).all()

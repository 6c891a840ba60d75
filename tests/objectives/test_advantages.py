from __future__ import annotations

import math

import pytest
import torch

from gspo_lightning.objectives import group_advantages


def test_known_values_use_bessel_corrected_std() -> None:
    # Group [1, 2, 3, 6]: mean 3, deviations -2, -1, 0, 3, squares sum to 14,
    # unbiased variance 14 / (4 - 1), std sqrt(14 / 3) = 2.1602...
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0])
    std = math.sqrt(14 / 3)
    expected = torch.tensor([-2 / std, -1 / std, 0.0, 3 / std])
    advantages = group_advantages(rewards, group_size=4)
    assert advantages.dtype == torch.float32
    torch.testing.assert_close(advantages, expected, atol=1e-6, rtol=0)


def test_group_of_two_binary_rewards() -> None:
    # [0, 1]: mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = sqrt(0.5), so A = -+0.5 / sqrt(0.5) = -+sqrt(0.5)
    advantages = group_advantages(torch.tensor([0.0, 1.0]), group_size=2)
    torch.testing.assert_close(advantages, torch.tensor([-math.sqrt(0.5), math.sqrt(0.5)]), atol=1e-6, rtol=0)


def test_zero_variance_group_gives_exact_zero() -> None:
    for value in (0.0, 1.0, 0.1, -3.7):
        advantages = group_advantages(torch.full((4,), value), group_size=4)
        assert not torch.isnan(advantages).any()
        assert torch.equal(advantages, torch.zeros(4))


def test_mixed_groups_are_normalised_independently() -> None:
    # Group 0 all equal -> zeros; group 1 [0, 0, 1, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3),
    # A = -+0.5 * sqrt(3); group 2 [2, 4, 2, 4]: the same shape scaled by 2 -> the same advantages.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.0, 0.0, 1.0, 1.0, 2.0, 4.0, 2.0, 4.0])
    half_sqrt3 = 0.5 * math.sqrt(3)
    expected = torch.tensor(
        [0.0] * 4 + [-half_sqrt3, -half_sqrt3, half_sqrt3, half_sqrt3] + [-half_sqrt3, half_sqrt3] * 2
    )
    advantages = group_advantages(rewards, group_size=4)
    torch.testing.assert_close(advantages, expected, atol=1e-6, rtol=0)
    assert torch.equal(advantages[:4], torch.zeros(4))


def test_low_precision_input_is_computed_in_float32() -> None:
    rewards = torch.tensor([0.0, 1.0, 3.0, 0.0], dtype=torch.bfloat16)
    advantages = group_advantages(rewards, group_size=2)
    assert advantages.dtype == torch.float32
    torch.testing.assert_close(
        advantages, torch.tensor([-math.sqrt(0.5), math.sqrt(0.5), math.sqrt(0.5), -math.sqrt(0.5)]),
        atol=1e-6, rtol=0,
    )


@pytest.mark.parametrize("group_size", [1, 0, -2])
def test_group_size_below_two_is_rejected(group_size: int) -> None:
    with pytest.raises(ValueError, match=rf"group_size must be >= 2.*group_size={group_size}"):
        group_advantages(torch.zeros(4), group_size=group_size)


def test_rewards_not_a_multiple_of_group_size_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"N=7 is not a multiple of group_size=4"):
        group_advantages(torch.zeros(7), group_size=4)


def test_rewards_must_be_one_dimensional() -> None:
    with pytest.raises(ValueError, match=r"rewards must be \[N\]"):
        group_advantages(torch.zeros(2, 4), group_size=4)


def test_batch_scale_divides_group_centred_rewards_by_the_std_of_all_rewards() -> None:
    # Groups [1, 2] and [3, 6]: centred [-0.5, 0.5] and [-1.5, 1.5]. All four rewards: mean 3, squared deviations
    # 4 + 1 + 0 + 9 = 14, Bessel-corrected std sqrt(14 / 3) = 2.1602.
    std = math.sqrt(14 / 3)
    advantages = group_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0]), group_size=2, scale="batch")
    torch.testing.assert_close(advantages, torch.tensor([-0.5, 0.5, -1.5, 1.5]) / std, atol=1e-6, rtol=0)
    # [0, 1] and [1, 1]: batch mean 0.75, squared deviations 0.5625 + 3 * 0.0625 = 0.75, std sqrt(0.75 / 3) = 0.5;
    # the zero-variance group stays exactly 0.
    advantages = group_advantages(torch.tensor([0.0, 1.0, 1.0, 1.0]), group_size=2, scale="batch")
    assert torch.equal(advantages, torch.tensor([-1.0, 1.0, 0.0, 0.0]))


def test_none_scale_only_subtracts_the_group_mean() -> None:
    advantages = group_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0, 0.5, 0.5]), group_size=2, scale="none")
    torch.testing.assert_close(advantages, torch.tensor([-0.5, 0.5, -1.5, 1.5, 0.0, 0.0]), atol=1e-6, rtol=0)
    advantages = group_advantages(torch.tensor([0.0, 0.0, 1.0, 3.0]), group_size=4, scale="none")
    torch.testing.assert_close(advantages, torch.tensor([-1.0, -1.0, 0.0, 2.0]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_zero_variance_gives_exact_zero_for_every_scale(scale: str) -> None:
    for value in (0.0, 1.0, 0.1, -3.7):
        advantages = group_advantages(torch.full((6,), value), group_size=3, scale=scale)
        assert torch.equal(advantages, torch.zeros(6))
    # A degenerate group next to a real one is exactly 0 too (0.1's group mean is not exact in float32).
    advantages = group_advantages(torch.tensor([0.1, 0.1, 0.1, 0.0, 1.0, 0.0]), group_size=3, scale=scale)
    assert torch.equal(advantages[:3], torch.zeros(3)) and (advantages[3:] != 0).all()


def test_default_scale_is_the_group_std() -> None:
    rewards = torch.tensor([0.1, 0.3, 0.2, 0.9, 2.0, 4.0, 2.0, 5.0])
    assert torch.equal(group_advantages(rewards, 4), group_advantages(rewards, 4, scale="group"))


def test_empty_rewards_give_empty_advantages() -> None:
    for scale in ("group", "batch", "none"):
        assert group_advantages(torch.zeros(0), group_size=4, scale=scale).shape == (0,)


def test_unknown_scale_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"scale must be one of group, batch, none, got scale='global'"):
        group_advantages(torch.zeros(4), group_size=2, scale="global")  # type: ignore[arg-type]


def test_turn_advantages_credit_each_turn_with_the_return_that_follows_it():
    from gspo_lightning.objectives.advantages import turn_advantages

    turn_rewards = torch.tensor([[-0.1, -0.1, 1.0], [0.5, 0.0, 0.0]])  # [N=2, K=3]: 3 turns, then 1 turn
    turn_index = torch.tensor([[0, 0, -1, 1, -1, 2, 2], [0, 0, -1, -1, -1, -1, -1]])  # [N, T]
    advantages = turn_advantages(turn_rewards, turn_index, torch.zeros(2, dtype=torch.bool), group_size=2)
    returns = [0.8, 0.9, 1.0, 0.5]  # episode 0 from turns 0, 1, 2; episode 1 from turn 0
    mean, std = 0.65, 0.3 / 2**0.5  # of the episode returns 0.8 and 0.5 (Bessel)
    a0, a1, a2, b0 = ((r - mean) / std for r in returns)
    expected = torch.tensor([[a0, a0, 0, a1, 0, a2, a2], [b0, b0, 0, 0, 0, 0, 0]])
    torch.testing.assert_close(advantages, expected, rtol=1e-6, atol=1e-6)


def test_turn_advantages_are_the_episodes_when_all_reward_comes_at_the_end():
    from gspo_lightning.objectives.advantages import turn_advantages

    rewards = torch.tensor([0.0, 1.0, 1.0, 0.3])
    turn_rewards = torch.zeros(4, 3)
    turn_rewards[torch.arange(4), torch.tensor([2, 0, 1, 2])] = rewards  # each episode's reward at its last turn
    turn_index = torch.tensor([[0, 1, 2], [0, -1, -1], [0, 1, -1], [0, 1, 2]])
    skipped = torch.tensor([False, False, True, True])
    advantages = turn_advantages(turn_rewards, turn_index, skipped, group_size=2)
    episode = group_advantages(rewards[:2], 2)  # the kept group's Eq. 6
    expected = torch.stack([episode[0].expand(3), torch.tensor([episode[1], 0, 0]), torch.zeros(3), torch.zeros(3)])
    assert torch.equal(advantages, expected)

"""Rollout-training mismatch correction: hand-computed weights and masks, and the objectives they feed."""

from __future__ import annotations

import math

import pytest
import torch

from gspo_lightning.objectives import (
    OBJECTIVE_PRESETS,
    RolloutCorrection,
    correct_rollout,
    mismatch_stats,
    objective_loss,
)

LOG2 = math.log(2.0)


def _batch():
    """Two responses of 3 and 2 tokens; per-token log(pi_old / pi_engine) chosen by hand; one padded slot."""
    engine = torch.zeros(2, 3)
    old = torch.tensor([[0.1, -0.2, 0.4], [1.0, 0.8, 0.0]])  # log-ratios; row 1's last slot is padding
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages = torch.tensor([1.0, -2.0])
    return old, engine, advantages, mask


def test_off_changes_nothing():
    old, engine, advantages, mask = _batch()
    corrected = correct_rollout(RolloutCorrection(), old, engine, advantages, mask, sequence_level=True)
    assert torch.equal(corrected.advantages, advantages) and torch.equal(corrected.mask, mask != 0)
    assert corrected.stats["masked_frac"] == 0 and corrected.stats["truncated_frac"] == 0


def test_token_level_tis_weights_each_token_by_its_capped_ratio():
    old, engine, advantages, mask = _batch()
    corrected = correct_rollout(RolloutCorrection("tis", 2.0), old, engine, advantages, mask, sequence_level=False)
    # weights min(exp(log r), 2): row 0 e^0.1, e^-0.2, e^0.4; row 1 e^1 -> 2 (capped), e^0.8 = 2.2255 -> 2
    expected = torch.tensor(
        [[math.exp(0.1), math.exp(-0.2), math.exp(0.4)], [-2.0 * 2.0, -2.0 * 2.0, -2.0 * 1.0]]
    )  # padding keeps weight 1
    torch.testing.assert_close(corrected.advantages, expected)
    torch.testing.assert_close(corrected.stats["truncated_frac"], torch.tensor(2 / 5))


def test_sequence_level_tis_weights_each_response_by_its_length_normalised_ratio():
    old, engine, advantages, mask = _batch()
    corrected = correct_rollout(RolloutCorrection("tis", 2.0), old, engine, advantages, mask, sequence_level=True)
    # row 0: exp(mean(0.1, -0.2, 0.4)) = exp(0.1); row 1: exp(mean(1.0, 0.8)) = exp(0.9) = 2.46 -> capped at 2
    torch.testing.assert_close(corrected.advantages, torch.tensor([math.exp(0.1), -2.0 * 2.0]))
    torch.testing.assert_close(corrected.stats["truncated_frac"], torch.tensor(2 / 5))  # row 1's 2 tokens


def test_mis_drops_responses_whose_sequence_ratio_leaves_the_bounds():
    old, engine, advantages, mask = _batch()
    corrected = correct_rollout(RolloutCorrection("mis", 2.0), old, engine, advantages, mask, sequence_level=True)
    # |mean log r|: row 0 0.1 <= log 2 kept; row 1 0.9 > log 2 = 0.693 dropped
    assert corrected.mask.tolist() == [[True, True, True], [False, False, False]]
    torch.testing.assert_close(corrected.stats["masked_frac"], torch.tensor(2 / 5))


def test_token_mask_drops_the_tokens_whose_ratio_leaves_the_bounds():
    old, engine, advantages, mask = _batch()
    corrected = correct_rollout(RolloutCorrection("token_mask", 2.0), old, engine, advantages, mask, False)
    assert corrected.mask.tolist() == [[True, True, True], [False, False, False]]  # 1.0, 0.8 > log 2
    corrected = correct_rollout(RolloutCorrection("token_mask", 3.0), old, engine, advantages, mask, False)
    assert corrected.mask.tolist() == [[True, True, True], [True, True, False]]  # log 3 = 1.10


@pytest.mark.parametrize("preset", ["gspo", "gspo_token", "grpo", "dapo", "dr_grpo"])
def test_tis_weights_enter_every_objective_as_a_factor_on_its_terms(preset):
    """With one response the weight w > 0 scales the whole loss: min(r w A, clip(r) w A) = w min(r A, clip(r) A)."""
    spec = OBJECTIVE_PRESETS[preset]
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = logprobs.detach() - 0.01  # ratios slightly above 1, inside GRPO's clip range
    engine = old - 0.3  # pi_old / pi_engine = e^0.3 = 1.35 on every token (below the cap 2)
    mask, advantages = torch.ones(1, 3), torch.tensor([1.5])
    sequence_level = spec.ratio == "sequence"
    corrected = correct_rollout(RolloutCorrection("tis", 2.0), old, engine, advantages, mask, sequence_level)
    eps = (0.2, 0.27)
    plain, _ = objective_loss(spec, logprobs, old, advantages, mask, *eps)
    weighted, _ = objective_loss(spec, logprobs, old, corrected.advantages, corrected.mask, *eps)
    torch.testing.assert_close(weighted, math.exp(0.3) * plain)


def test_mismatch_stats_by_hand():
    old, engine, _, mask = _batch()
    stats = mismatch_stats(old, engine, mask)
    tokens = [0.1, -0.2, 0.4, 1.0, 0.8]
    k3 = [math.exp(d) - d - 1 for d in tokens]  # k3 of log(pi_trainer / pi_engine): KL(engine || trainer)
    torch.testing.assert_close(stats["kl"], torch.tensor(sum(k3) / 5))
    torch.testing.assert_close(stats["log_ratio_abs_max"], torch.tensor(0.9))
    torch.testing.assert_close(stats["log_ratio_p50"], torch.tensor(0.5))  # median of 0.1 and 0.9
    assert mismatch_stats(engine, engine, mask)["kl"] == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"mode": "is"}, r"rollout_correction.mode must be one of \['off', 'tis', 'mis', 'token_mask'\]"),
        ({"mode": "tis", "threshold": 1.0}, r"rollout_correction.threshold must be a number > 1"),
    ],
)
def test_bad_settings_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        RolloutCorrection(**fields)

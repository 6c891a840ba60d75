"""The loss under staleness: behaviour (engine) log-probs against the proximal pi_old, corrected at the sequence
level for sequence-ratio objectives with a length-normalised, bounded weight. Hand-computed figures."""

from __future__ import annotations

import math

import pytest
import torch

from gspo_lightning.objectives import RolloutCorrection
from gspo_lightning.objectives.rollout_correction import correct_rollout

TIS = RolloutCorrection("tis", threshold=2.0)


def _long_response(length: int, gap: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One response of ``length`` tokens whose proximal log-prob is ``gap`` above the behaviour's at every token."""
    behaviour = torch.full((1, length), -1.5, dtype=torch.float64)
    return behaviour + gap, behaviour, torch.ones(1, length)


@pytest.mark.parametrize("length", [64, 2048, 8192])
def test_a_stale_long_response_keeps_its_weight_at_the_sequence_level(length):
    # The per-token gap of a version-old sample: 0.01 nats. The product of token ratios exp(-0.01 * L) would be
    # 0.53 at 64 tokens, 2e-9 at 2048, 1e-36 at 8192: the effective learning rate gone. GSPO's weight is the
    # length-normalised exp(mean) = exp(-0.01), whatever the length.
    proximal, behaviour, mask = _long_response(length, -0.01)
    corrected = correct_rollout(TIS, proximal, behaviour, torch.tensor([2.0]), mask, sequence_level=True)
    assert corrected.advantages.item() == pytest.approx(2.0 * math.exp(-0.01), abs=1e-6)  # float32, as the correction computes
    assert math.exp(-0.01 * length) < 0.6  # what the product form would have left of it


def test_the_sequence_weight_is_capped_at_the_threshold():
    proximal, behaviour, mask = _long_response(100, +1.0)  # the proximal policy likes it e-times more per token
    corrected = correct_rollout(TIS, proximal, behaviour, torch.tensor([1.0]), mask, sequence_level=True)
    assert corrected.advantages.item() == pytest.approx(2.0, abs=1e-6)  # float32, as the correction computes  # min(e, C = 2)
    assert corrected.stats["truncated_frac"].item() == 1.0


def test_token_level_objectives_weigh_each_token():
    proximal = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    behaviour = torch.tensor([[-1.2, -1.0, -0.5]], dtype=torch.float64)
    corrected = correct_rollout(TIS, proximal, behaviour, torch.tensor([1.0]), torch.ones(1, 3), sequence_level=False)
    expected = [math.exp(0.2), math.exp(-1.0), 1.0]
    assert corrected.advantages[0].tolist() == pytest.approx(expected, abs=1e-6)  # float32, as the correction computes


def test_sequence_mis_leaves_out_a_sample_too_stale_and_keeps_the_rest():
    proximal = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    behaviour = torch.tensor([[-1.1, -0.9], [-2.0, -2.0]], dtype=torch.float64)  # mean gaps 0 and +1 (> log 2)
    mis = RolloutCorrection("mis", threshold=2.0)
    corrected = correct_rollout(mis, proximal, behaviour, torch.ones(2), torch.ones(2, 2), sequence_level=True)
    assert corrected.mask.tolist() == [[True, True], [False, False]]
    assert corrected.stats["masked_frac"].item() == 0.5

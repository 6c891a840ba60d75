"""Policy-version lag of tokens and sequences, against hand-computed figures."""

from __future__ import annotations

import pytest
import torch

from gspo_lightning.asynchronous.metrics import version_lag_stats


def test_lag_of_tokens_and_sequences_by_hand():
    # trained at version 5; row 0: tokens of versions 5, 5 (lag 0); row 1: 3, 4 (lag 2, 1: the sequence's is 2);
    # row 2: one token of version 1 (lag 4, counted in the last bucket of longest=3); row 3: no policy token
    versions = torch.tensor([[5, 5, -1], [3, 4, -1], [1, -1, -1], [-1, -1, -1]])
    stats = version_lag_stats(versions, trained_version=5, longest=3)
    assert torch.allclose(stats["lag_tokens_mean"], torch.tensor((0 + 0 + 2 + 1 + 4) / 5))
    assert stats["lag_tokens_max"] == 4
    assert torch.allclose(stats["lag_sequences_mean"], torch.tensor((0 + 2 + 4) / 3))
    assert stats["lag_sequences_max"] == 4
    fractions = [float(stats[f"lag_sequences_frac_{k}"]) for k in range(4)]
    assert fractions == pytest.approx([1 / 3, 0.0, 1 / 3, 1 / 3], abs=1e-7)
    assert all(value.dtype == torch.float32 and value.dim() == 0 for value in stats.values())


def test_no_policy_token_gives_zeros_not_nan():
    stats = version_lag_stats(torch.full((2, 3), -1), trained_version=2, longest=1)
    assert all(float(value) == 0.0 for value in stats.values())

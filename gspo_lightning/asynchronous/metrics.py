"""How stale the samples of a round are: policy-version lag of tokens and sequences. Pure functions."""

from __future__ import annotations

import torch
from torch import Tensor


def version_lag_stats(policy_versions: Tensor, trained_version: int, longest: int) -> dict[str, Tensor]:
    """Lag statistics of one round's samples, trained at ``trained_version``.

    Args:
        policy_versions: [N, R] int64, the version that sampled each token, -1 where there is no policy token.
        trained_version: the trainer's version at the start of the round (the proximal policy's).
        longest: the largest lag the histogram reports on its own (the setting's bound); older ones count in it.

    Returns:
        ``lag_tokens_mean`` and ``lag_tokens_max`` over the policy's tokens; ``lag_sequences_mean`` and
        ``lag_sequences_max`` over responses (a response's lag is its oldest token's); ``lag_sequences_frac_<k>``
        for k = 0 .. ``longest``: the fraction of responses of lag k. Float32 scalars.
    """
    tokens = policy_versions >= 0  # [N, R]
    token_lags = (trained_version - policy_versions).clamp(min=0)[tokens].float()  # [M]
    sequence_lags = response_lags(policy_versions, trained_version)[tokens.any(-1)]  # [N']
    stats = {
        "lag_tokens_mean": _mean(token_lags),
        "lag_tokens_max": token_lags.max() if token_lags.numel() else torch.zeros(()),
        "lag_sequences_mean": _mean(sequence_lags.float()),
        "lag_sequences_max": sequence_lags.max().float() if sequence_lags.numel() else torch.zeros(()),
    }
    counted = sequence_lags.clamp(max=longest)  # [N']
    for k in range(longest + 1):
        stats[f"lag_sequences_frac_{k}"] = _mean((counted == k).float())
    return {name: value.float().cpu() for name, value in stats.items()}


def _mean(values: Tensor) -> Tensor:
    return values.mean() if values.numel() else torch.zeros(())


def response_lags(policy_versions: Tensor, trained_version: int) -> Tensor:
    """[N] int64: each response's lag (its oldest policy token's), 0 for a response without policy tokens."""
    tokens = policy_versions >= 0  # [N, R]
    lag = (trained_version - policy_versions).clamp(min=0)  # [N, R]
    return torch.where(tokens, lag, 0).amax(-1)  # [N]


"""GRPO, the token-level baseline (GSPO paper Eq. 2)."""

from __future__ import annotations

import torch
from torch import Tensor

from gspo_lightning.objectives.clipping import (
    clip_fraction_stats,
    clipped_surrogate,
    mean_over_valid,
    ratio_stats,
    token_log_ratio,
    validate_clip_range,
    validate_shapes,
)
from gspo_lightning.objectives.gspo import sequence_log_ratio


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``-J_GRPO``: per-token clipped surrogate, mean over each response's tokens, mean over responses (Eq. 2).

    The token ratio is ``w_i,t = exp(log pi_theta - log pi_old)`` (float32), each token clipped on its own.
    Responses weigh ``1 / N_valid`` each; empty responses are left out and counted. ``old_logprobs`` and
    ``advantages`` are constants of the objective (detached). Padding contributes nothing, even NaN/inf values.

    Args:
        logprobs, old_logprobs, mask: [N, T]; mask nonzero on response tokens (bool, int or float).
        advantages: [N] one advantage per response, shared by its tokens (Eq. 6).
        eps_low, eps_high: clip range ``[1 - eps_low, 1 + eps_high]``, each in (0, 1).

    Returns:
        ``(loss, stats)`` with the keys of ``gspo_loss``: ``clip_frac*`` count tokens whose own ratio is
        clipped (over all response tokens), ``ratio_mean/min/max`` are over response tokens (1 when none),
        ``seq_log_ratio_abs_mean`` is the mean over responses of |mean token log-ratio| (GSPO's |log s_i|,
        for comparability), ``num_empty`` counts responses without tokens.
    """
    validate_clip_range(eps_low, eps_high)
    validate_shapes(logprobs, old_logprobs, advantages, mask)
    token_mask = mask != 0  # [N, T]
    lengths = token_mask.sum(dim=1).float()  # [N]
    valid = lengths > 0  # [N]
    token_ratio = token_log_ratio(logprobs, old_logprobs, token_mask).exp()  # [N, T], 1 on padding
    token_objective, clipped_low, clipped_high = clipped_surrogate(
        token_ratio, advantages.detach().float().unsqueeze(1), eps_low, eps_high
    )  # [N, T] each
    masked_objective = torch.where(token_mask, token_objective, torch.zeros_like(token_objective))  # [N, T]
    response_objective = masked_objective.sum(dim=1) / lengths.clamp(min=1.0)  # [N]
    loss = -mean_over_valid(response_objective, valid)  # []

    stats = clip_fraction_stats(
        (clipped_low & token_mask).sum(), (clipped_high & token_mask).sum(), lengths.sum()
    )
    stats.update(ratio_stats(token_ratio, token_mask))
    log_ratio = sequence_log_ratio(logprobs.detach(), old_logprobs, mask)  # [N]
    stats["seq_log_ratio_abs_mean"] = mean_over_valid(log_ratio.abs(), valid)
    stats["num_empty"] = (~valid).sum().float()
    return loss, {name: value.detach().float() for name, value in stats.items()}

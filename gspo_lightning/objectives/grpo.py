"""GRPO, the token-level baseline (GSPO paper Eq. 2), and its token-level clipped surrogate
``min(w_i,t A_i, clip(w_i,t) A_i)``, which DAPO (``dapo.py``) and Dr. GRPO (``dr_grpo.py``) aggregate differently.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gspo_lightning.objectives.aggregation import aggregate_sequence_mean, masked_values
from gspo_lightning.objectives.clipping import (
    clipped_surrogate,
    exp_with_linear_tail,
    reference_token_terms,
    surrogate_stats,
    token_log_ratio,
    validate_clip_range,
    validate_shapes,
)
from gspo_lightning.objectives.gspo import sequence_log_ratio
from gspo_lightning.objectives.gspo_token import per_token_advantages
from gspo_lightning.objectives.registry import Objective, register


def grpo_token_objective(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """The per-token clipped surrogate of Eq. 2, before aggregation.

    Returns ``(token_objective, token_mask, stats)``: [N, T] float32 (exact 0 on padding), [N, T] bool and
    the detached stats of ``grpo_loss``. The ratio ``w_i,t`` is ``exp_with_linear_tail`` of the float32
    token log-ratio: exact ``exp`` up to a log-ratio of 20, finite beyond it (see that function).
    """
    validate_clip_range(eps_low, eps_high)
    validate_shapes(logprobs, old_logprobs, advantages, mask, per_token_advantages=True)
    token_mask = mask != 0  # [N, T]
    lengths = token_mask.sum(dim=1).float()  # [N]
    valid = lengths > 0  # [N]
    token_ratio = exp_with_linear_tail(token_log_ratio(logprobs, old_logprobs, token_mask))  # [N, T], 1 on padding
    token_objective, clipped_low, clipped_high = clipped_surrogate(
        token_ratio, per_token_advantages(advantages, token_mask), eps_low, eps_high
    )  # [N, T] each

    log_ratio = sequence_log_ratio(logprobs.detach(), old_logprobs, mask)  # [N]
    stats = surrogate_stats(
        (clipped_low & token_mask).sum(), (clipped_high & token_mask).sum(), lengths, token_ratio, token_mask,
        log_ratio, valid,
    )  # fmt: skip
    return masked_values(token_objective, token_mask), token_mask, stats


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
        advantages: [N] one advantage per response, shared by its tokens (Eq. 6), or [N, T] one per token (e.g.
            weighted by a rollout correction).
        eps_low, eps_high: clip range ``[1 - eps_low, 1 + eps_high]``, each in (0, 1).

    Returns:
        ``(loss, stats)`` with the keys of ``gspo_loss``: ``clip_frac*`` count tokens whose own ratio is
        clipped (over all response tokens), ``ratio_mean/min/max`` are over response tokens (1 when none),
        ``seq_log_ratio_abs_mean`` is the mean over responses of |mean token log-ratio| (GSPO's |log s_i|,
        for comparability), ``num_empty`` counts responses without tokens.
    """
    token_objective, token_mask, stats = grpo_token_objective(
        logprobs, old_logprobs, advantages, mask, eps_low, eps_high
    )  # [N, T], [N, T]
    return -aggregate_sequence_mean(token_objective, token_mask), stats


def token_surrogate_reference(logprobs, old_logprobs, advantages, mask, eps_low, eps_high):
    """The per-token clipped surrogate of each response, token by token (float64): [[term, ...], ...]."""

    def surrogate(ratio, advantage, logprob):
        return torch.minimum(ratio * advantage, ratio.clamp(1 - eps_low, 1 + eps_high) * advantage)

    return reference_token_terms(logprobs, old_logprobs, advantages, mask, surrogate)


def grpo_reference_loss(logprobs, old_logprobs, advantages, mask, eps_low, eps_high):
    """Eq. 2 response by response: each response's token mean, then the mean over responses."""
    rows = [terms for terms in token_surrogate_reference(logprobs, old_logprobs, advantages, mask, eps_low, eps_high)
            if terms]  # fmt: skip
    return -(sum(sum(terms) / len(terms) for terms in rows) / len(rows)) if rows else logprobs.sum() * 0.0, {}


register(
    Objective(
        name="grpo",
        loss=grpo_loss,
        reference_loss=grpo_reference_loss,
        ratio="token",
        aggregation="sequence_mean",
        clip_range=(0.2, 0.27),
        per_token_advantages=True,
        paper="GRPO (Shao et al., 2024) as the GSPO paper writes it, Eq. 2; section 5.1's tuned clip range",
    )
)

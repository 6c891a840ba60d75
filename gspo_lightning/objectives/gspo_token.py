"""GSPO-token: GSPO's sequence ratio with per-token advantages (GSPO paper Eqs. 13-17)."""

from __future__ import annotations

import torch
from torch import Tensor

from gspo_lightning.objectives.aggregation import aggregate_sequence_mean
from gspo_lightning.objectives.clipping import (
    clipped_surrogate,
    exp_with_linear_tail,
    surrogate_stats,
    validate_clip_range,
    validate_shapes,
)
from gspo_lightning.objectives.gspo import sequence_log_ratio
from gspo_lightning.objectives.registry import Objective, register


def gspo_token_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """``log s_i,t = sg[log s_i] + log pi_theta(y_i,t) - sg[log pi_theta(y_i,t)]`` (Eq. 17, in log space).

    Equal to ``log s_i`` in value on every response token, but its gradient reaches only token t, with weight 1:
    ``d s_i,t / d log pi_theta(y_i,t) = s_i,t``. ``s_i`` is computed over the whole response (Eq. 7) before it
    is detached. Returns [N, T] float32; on padding it is ``log s_i`` with no gradient (even NaN/inf there).
    """
    log_sequence_ratio = sequence_log_ratio(logprobs.detach(), old_logprobs, mask)  # [N]
    return _attach_token_gradients(log_sequence_ratio, logprobs, mask != 0)  # [N, T]


def _attach_token_gradients(log_sequence_ratio: Tensor, logprobs: Tensor, token_mask: Tensor) -> Tensor:
    """``sg[log s_i] + (log pi_theta - sg[log pi_theta])`` on response tokens, ``sg[log s_i]`` on padding."""
    current = logprobs.float()  # [N, T]
    carrier = torch.where(token_mask, current - current.detach(), torch.zeros_like(current))  # [N, T], value 0
    return log_sequence_ratio.detach().unsqueeze(1) + carrier  # [N, T]


def per_token_advantages(advantages: Tensor, token_mask: Tensor) -> Tensor:
    """``A_i,t`` as detached float32 [N, T] from [N] (broadcast along the response) or [N, T]; 0 on padding."""
    values = advantages.detach().float()  # [N] or [N, T]
    values = values.unsqueeze(1).expand(token_mask.shape) if values.dim() == 1 else values  # [N, T]
    return torch.where(token_mask, values, torch.zeros_like(values))  # [N, T]


def gspo_token_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``-J_GSPO-token``: ``-1/N_valid sum_i 1/|y_i| sum_t min(s_i,t A_i,t, clip(s_i,t) A_i,t)`` (Eqs. 13-17).

    Each token is clipped on its own, but every token of a response has the same ratio value ``s_i``, so with
    per-response advantages the decisions are per response and the loss, its gradient and the stats equal
    ``gspo_loss``'s. It differs when advantages vary along a response (multi-turn, tool use): token t's
    gradient is ``-s_i A_i,t / (N_valid |y_i|)``. Responses weigh ``1 / N_valid``; empty ones are left out and
    counted. ``old_logprobs`` and ``advantages`` are constants (detached); padding contributes nothing, even
    NaN/inf values (in ``advantages`` too). Ratios above e^20 follow ``exp_with_linear_tail``.

    Args:
        logprobs, old_logprobs, mask: [N, T]; mask nonzero on response tokens (bool, int or float).
        advantages: [N] (shared by a response's tokens) or [N, T] (one per token, ``A_i,t``).
        eps_low, eps_high: clip range ``[1 - eps_low, 1 + eps_high]``, each in (0, 1).

    Returns:
        ``(loss, stats)`` with the keys of ``gspo_loss``: ``clip_frac*`` count clipped response tokens over all
        response tokens, ``ratio_mean/min/max`` are of ``s_i`` over valid responses (as in ``gspo_loss``),
        ``seq_log_ratio_abs_mean`` is the mean |log s_i|, ``num_empty`` counts responses without tokens.
    """
    validate_clip_range(eps_low, eps_high)
    validate_shapes(logprobs, old_logprobs, advantages, mask, per_token_advantages=True)
    token_mask = mask != 0  # [N, T]
    lengths = token_mask.sum(dim=1).float()  # [N]
    valid = lengths > 0  # [N]
    # s_i over the whole response, then detached (Eq. 17); the float32 sum is shared with the stats.
    log_ratio = sequence_log_ratio(logprobs.detach(), old_logprobs, mask)  # [N]
    token_ratio = exp_with_linear_tail(_attach_token_gradients(log_ratio, logprobs, token_mask))  # [N, T]
    token_objective, clipped_low, clipped_high = clipped_surrogate(
        token_ratio, per_token_advantages(advantages, token_mask), eps_low, eps_high
    )  # [N, T] each
    loss = -aggregate_sequence_mean(token_objective, token_mask)  # []
    stats = surrogate_stats(
        (clipped_low & token_mask).sum(), (clipped_high & token_mask).sum(), lengths,
        exp_with_linear_tail(log_ratio), valid, log_ratio, valid,
    )  # fmt: skip
    return loss, stats


def gspo_token_reference_loss(logprobs, old_logprobs, advantages, mask, eps_low, eps_high):
    """Eqs. 13-17 token by token (float64): s_i,t = sg[s_i] pi / sg[pi], each token's min, per-response mean."""
    responses = []
    for i in range(len(logprobs)):
        tokens = [t for t in range(logprobs.shape[1]) if mask[i, t] != 0]
        if not tokens:
            continue
        log_s = sum(logprobs[i, t].double() - old_logprobs[i, t].double() for t in tokens) / len(tokens)
        terms = []
        for t in tokens:
            ratio = torch.exp(log_s.detach() + logprobs[i, t].double() - logprobs[i, t].double().detach())
            a = (advantages[i, t] if advantages.dim() == 2 else advantages[i]).double()
            terms.append(torch.minimum(ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a))
        responses.append(sum(terms) / len(terms))
    return -(sum(responses) / len(responses)) if responses else logprobs.sum() * 0.0, {}


register(
    Objective(
        name="gspo_token",
        loss=gspo_token_loss,
        reference_loss=gspo_token_reference_loss,
        ratio="sequence",
        aggregation="sequence_mean",
        clip_range=(3e-4, 4e-4),
        per_token_advantages=True,
        paper="GSPO (Zheng et al., 2025, arXiv 2507.18071), Eqs. 13-17",
    )
)

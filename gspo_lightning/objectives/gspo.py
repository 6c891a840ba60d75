"""GSPO: the sequence-level clipped objective (GSPO paper Eqs. 5 and 7)."""

from __future__ import annotations

import torch
from torch import Tensor

from gspo_lightning.objectives.clipping import (
    clipped_surrogate,
    exp_with_linear_tail,
    mean_over_valid,
    surrogate_stats,
    token_log_ratio,
    validate_clip_range,
    validate_shapes,
)
from gspo_lightning.objectives.registry import Objective, register


def sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """``log s_i = 1/|y_i| * sum_t (log pi_theta - log pi_old)`` over response tokens (Eq. 7).

    Args:
        logprobs: [N, T] log-probabilities of the sampled tokens under the current policy.
        old_logprobs: [N, T] the same under the policy that generated the rollout (treated as a constant).
        mask: [N, T] nonzero on response tokens, zero on padding (bool, int or float).

    Returns:
        [N] float32; 0 for an empty response. Padding contributes nothing, even NaN/inf values.
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape or logprobs.dim() != 2:
        raise ValueError(
            "logprobs, old_logprobs and mask must all be [N, T], got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)} and {tuple(mask.shape)}"
        )
    token_mask = mask != 0  # [N, T]
    lengths = token_mask.sum(dim=1).float()  # [N]
    # Summed in float32: a long response's bf16 sum would lose the small differences that matter here.
    summed = token_log_ratio(logprobs, old_logprobs, token_mask).sum(dim=1)  # [N]
    return summed / lengths.clamp(min=1.0)  # [N]


def sequence_ratio(log_ratio: Tensor, max_log_ratio: float | None = None) -> Tensor:
    """``s_i = exp(log s_i)`` [N]: with ``max_log_ratio`` C, ``exp(clamp(log s_i, -C, C))``, so that no response,
    however far off-policy, gives an inf or NaN ratio (the gradient is 0 beyond C, where the clip range lies far
    inside anyway); without it, exact up to log s = 20 and continued linearly beyond (``exp_with_linear_tail``)."""
    if max_log_ratio is None:
        return exp_with_linear_tail(log_ratio)
    return torch.exp(log_ratio.clamp(-max_log_ratio, max_log_ratio))


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    max_log_ratio: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``-J_GSPO``: minus the mean over responses of ``min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i)``.

    Eq. 5 with the length-normalised sequence ratio ``s_i`` of Eq. 7; its gradient is Eq. 10. Each response
    weighs ``1 / N_valid`` whatever its length: a token mean would re-weight responses by length and is not
    GSPO. Responses with no tokens are left out of the mean; if none has tokens the loss is a zero still
    attached to ``logprobs`` (its backward gives zero gradients). ``old_logprobs`` and ``advantages`` are
    constants of the objective (detached). See :func:`sequence_ratio` for ``max_log_ratio``.

    Args:
        logprobs, old_logprobs, mask: [N, T] (see ``sequence_log_ratio``).
        advantages: [N] one advantage per response (Eq. 6).
        eps_low, eps_high: clip range ``[1 - eps_low, 1 + eps_high]``, each in (0, 1).

    Returns:
        ``(loss, stats)``: a float32 scalar, and detached float32 scalars ``clip_frac`` (fraction of response
        tokens in responses whose gradient clipping removed), ``clip_frac_low`` (A < 0, s < 1 - eps_low),
        ``clip_frac_high`` (A > 0, s > 1 + eps_high), ``ratio_mean/min/max`` (of s_i over valid responses, 1
        when none), ``seq_log_ratio_abs_mean`` (mean |log s_i|) and ``num_empty``.
    """
    validate_clip_range(eps_low, eps_high)
    validate_shapes(logprobs, old_logprobs, advantages, mask)
    lengths = (mask != 0).sum(dim=1).float()  # [N]
    valid = lengths > 0  # [N]
    log_ratio = sequence_log_ratio(logprobs, old_logprobs, mask)  # [N]
    ratio = sequence_ratio(log_ratio, max_log_ratio)  # [N]
    objective, clipped_low, clipped_high = clipped_surrogate(
        ratio, advantages.detach().float(), eps_low, eps_high
    )  # [N] each
    loss = -mean_over_valid(objective, valid)  # []
    # Empty responses have length 0, so they never count towards the token-weighted clip fractions.
    stats = surrogate_stats(
        (lengths * clipped_low).sum(), (lengths * clipped_high).sum(), lengths, ratio, valid, log_ratio, valid
    )
    return loss, stats


def gspo_reference_loss(logprobs, old_logprobs, advantages, mask, eps_low, eps_high, max_log_ratio=None):
    """Eqs. 5 and 7 response by response, token by token (float64): the oracle of the tests."""
    terms = []
    for i in range(len(logprobs)):
        tokens = [t for t in range(logprobs.shape[1]) if mask[i, t] != 0]
        if not tokens:
            continue
        log_s = sum(logprobs[i, t].double() - old_logprobs[i, t].double() for t in tokens) / len(tokens)
        if max_log_ratio is not None:
            log_s = log_s.clamp(-max_log_ratio, max_log_ratio)
        s, a = torch.exp(log_s), advantages[i].double()
        terms.append(torch.minimum(s * a, s.clamp(1 - eps_low, 1 + eps_high) * a))
    return -(sum(terms) / len(terms)) if terms else logprobs.sum() * 0.0, {}


register(
    Objective(
        name="gspo",
        loss=gspo_loss,
        reference_loss=gspo_reference_loss,
        ratio="sequence",
        aggregation="sequence_mean",
        clip_range=(3e-4, 4e-4),
        options={"max_log_ratio": None},
        paper="GSPO (Zheng et al., 2025, arXiv 2507.18071), Eqs. 5, 7; section 5.1's clip range",
    )
)

"""GSPO: the sequence-level clipped objective (GSPO paper Eqs. 5 and 7)."""

from __future__ import annotations

from torch import Tensor

from gspo_lightning.objectives.clipping import (
    clip_fraction_stats,
    clipped_surrogate,
    exp_with_linear_tail,
    mean_over_valid,
    ratio_stats,
    token_log_ratio,
    validate_clip_range,
    validate_shapes,
)


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


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``-J_GSPO``: minus the mean over responses of ``min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i)``.

    Eq. 5 with the length-normalised sequence ratio ``s_i`` of Eq. 7; its gradient is Eq. 10. Each response
    weighs ``1 / N_valid`` whatever its length: a token mean would re-weight responses by length and is not
    GSPO. Responses with no tokens are left out of the mean; if none has tokens the loss is a zero still
    attached to ``logprobs`` (its backward gives zero gradients). ``old_logprobs`` and ``advantages`` are
    constants of the objective (detached). ``s_i = exp(log s_i)`` is exact up to ``log s_i = 20``; beyond it
    ``exp_with_linear_tail`` keeps value and gradient finite without dropping the real gradient of A < 0.

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
    ratio = exp_with_linear_tail(log_ratio)  # [N], exact exp up to log s = 20, finite beyond
    objective, clipped_low, clipped_high = clipped_surrogate(
        ratio, advantages.detach().float(), eps_low, eps_high
    )  # [N] each
    loss = -mean_over_valid(objective, valid)  # []

    # Empty responses have length 0, so they never count towards the token-weighted clip fractions.
    stats = clip_fraction_stats(
        (lengths * clipped_low).sum(), (lengths * clipped_high).sum(), lengths.sum()
    )
    stats.update(ratio_stats(ratio, valid))
    stats["seq_log_ratio_abs_mean"] = mean_over_valid(log_ratio.detach().abs(), valid)
    stats["num_empty"] = (~valid).sum().float()
    return loss, {name: value.detach().float() for name, value in stats.items()}

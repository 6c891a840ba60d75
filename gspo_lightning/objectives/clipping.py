"""Shared pieces of the clipped-surrogate objectives (GSPO Eq. 5, GRPO Eq. 2).

Both objectives take ``min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)``; they differ only in what
the ratio is (one per response for GSPO, one per token for GRPO). Everything here is a pure function of tensors.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# Above this log-ratio, exp is continued along its tangent (see `exp_with_linear_tail`). e^20 = 4.85e8 lies far
# outside any clip range, yet its square (as in a gradient norm) is still finite in float32.
MAX_EXP_LOG_RATIO = 20.0


def validate_clip_range(eps_low: float, eps_high: float) -> None:
    """Raise ValueError unless ``0 < eps_low < 1`` and ``0 < eps_high < 1`` (NaN is rejected too)."""
    for name, value in (("eps_low", eps_low), ("eps_high", eps_high)):
        if not 0.0 < float(value) < 1.0:
            raise ValueError(f"{name} must satisfy 0 < {name} < 1, got {name}={value!r}")


def validate_shapes(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, per_token_advantages: bool = False
) -> None:
    """Raise ValueError unless logprobs, old_logprobs and mask are [N, T] and advantages is [N].

    With ``per_token_advantages`` advantages may also be [N, T] (GSPO-token, Eqs. 13-17).
    """
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [N, T], got shape {tuple(logprobs.shape)}")
    for name, tensor in (("old_logprobs", old_logprobs), ("mask", mask)):
        if tensor.shape != logprobs.shape:
            raise ValueError(
                f"{name} must have the shape of logprobs {tuple(logprobs.shape)}, got {tuple(tensor.shape)}"
            )
    if advantages.shape == logprobs.shape[:1] or (per_token_advantages and advantages.shape == logprobs.shape):
        return
    per_token = f" or [N, T] = {tuple(logprobs.shape)} (one per token)" if per_token_advantages else ""
    raise ValueError(
        f"advantages must be [N] = {tuple(logprobs.shape[:1])} (one per response){per_token}, "
        f"got {tuple(advantages.shape)}"
    )


def token_log_ratio(logprobs: Tensor, old_logprobs: Tensor, token_mask: Tensor) -> Tensor:
    """Per-token ``log pi_theta - log pi_old`` in float32, exactly 0 on padding.

    ``torch.where`` (not a multiplication by the mask) keeps a NaN/inf at a padded position out of both the
    value and the gradient: ``0 * nan`` would be NaN, the branch not taken by ``where`` gets a zero gradient.
    ``old_logprobs`` is a constant of the objective, so it is detached.
    """
    difference = logprobs.float() - old_logprobs.detach().float()  # [N, T]
    return torch.where(token_mask, difference, torch.zeros_like(difference))  # [N, T]


def exp_with_linear_tail(log_ratio: Tensor) -> Tensor:
    """``exp(x)`` for ``x <= MAX_EXP_LOG_RATIO`` (20), its tangent ``e^20 * (1 + x - 20)`` above it.

    Turns a log-ratio into a ratio with a finite value and gradient for any finite log-ratio. ``exp`` alone
    overflows float32 above 88.7 (a log-ratio of 1e4 on one token of a short response), and its backward
    ``grad * exp(x)`` then makes even a zero gradient ``0 * inf = NaN``.

    A plain clamp of the log-ratio is not used because above the cap the clipped objectives (Eqs. 2, 5, 13)
    behave according to the sign of A:

    - A > 0: ratio > 1 + eps_high, the min picks the constant clipped branch: value (1 + eps_high) A and zero
      gradient, whatever the ratio. The tail changes nothing here.
    - A = 0: value 0 and gradient 0 either way.
    - A < 0: the min keeps the unclipped ``ratio * A``; its gradient is real (it pushes down the likelihood of
      the response that moved most in the wrong direction) and a clamp would silently drop it. The tangent
      keeps its sign and direction with its size capped at ``e^20 |A|`` per unit of log-ratio, and the loss
      still grows with the log-ratio. (The exact ``e^x |A|`` overflows float32 above x = 88.7, and its square
      in a gradient norm already above x = 44; under gradient-norm clipping the direction is what counts.)

    At or below the cap the value and gradient are bitwise those of ``torch.exp``. Nothing is done on the low
    side: exp underflows to 0 with a zero gradient, exact to float32. The branches are selected with
    ``torch.where`` (not ``exp(clamp(x)) + e^20 * (x - clamp(x))``): the gradients of e^20-sized terms that
    cancel would wipe out the precision of ordinary ratios. Inputs must be finite on response tokens.
    """
    above = log_ratio > MAX_EXP_LOG_RATIO  # log_ratio's shape
    capped = torch.where(above, torch.full_like(log_ratio, MAX_EXP_LOG_RATIO), log_ratio)  # log_ratio's shape
    tangent = math.exp(MAX_EXP_LOG_RATIO) * (1.0 + (log_ratio - MAX_EXP_LOG_RATIO))  # log_ratio's shape
    return torch.where(above, tangent, capped.exp())  # log_ratio's shape


def clipped_surrogate(
    ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """``min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)`` and where the clipped branch wins.

    ``advantages`` broadcasts against ``ratio``. Returns ``(objective, clipped_low, clipped_high)``; the two
    boolean masks mark exactly where the min picks the constant clipped branch, i.e. where clipping removes
    the gradient: ``A < 0 and ratio < 1 - eps_low`` or ``A > 0 and ratio > 1 + eps_high``. Selecting the branch
    with ``where`` equals the min in value and gives the full (not tie-split) gradient inside the clip range.
    """
    clipped_low = (advantages < 0) & (ratio < 1.0 - eps_low)  # ratio's shape
    clipped_high = (advantages > 0) & (ratio > 1.0 + eps_high)  # ratio's shape
    clipped_ratio = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)  # ratio's shape
    objective = torch.where(clipped_low | clipped_high, clipped_ratio * advantages, ratio * advantages)
    return objective, clipped_low, clipped_high


def mean_over_valid(values: Tensor, valid: Tensor) -> Tensor:
    """Mean of ``values`` where ``valid``; 0 (still attached to the graph) when nothing is valid."""
    total = torch.where(valid, values, torch.zeros_like(values)).sum()  # []
    return total / valid.sum().clamp(min=1)


def clip_fraction_stats(
    clipped_low_weight: Tensor, clipped_high_weight: Tensor, total_tokens: Tensor
) -> dict[str, Tensor]:
    """Token-weighted clip fractions from the number of tokens clipped on each side (0 when no tokens)."""
    denominator = total_tokens.float().clamp(min=1.0)  # []
    low = clipped_low_weight.float() / denominator  # []
    high = clipped_high_weight.float() / denominator  # []
    return {"clip_frac": low + high, "clip_frac_low": low, "clip_frac_high": high}


def ratio_stats(ratio: Tensor, valid: Tensor) -> dict[str, Tensor]:
    """Mean/min/max of ``ratio`` where ``valid``; 1.0 (no policy change) for all three when nothing is valid.

    Written without boolean indexing or ``if`` on tensor values so that it never synchronises with the device.
    """
    ratio = ratio.detach().float()
    any_valid = valid.any()  # []
    one = torch.ones((), dtype=torch.float32, device=ratio.device)
    infinity = torch.full((1,), float("inf"), dtype=torch.float32, device=ratio.device)
    # The appended sentinel keeps amin/amax defined on an empty batch (N = 0).
    lowest = torch.cat([torch.where(valid, ratio, infinity).flatten(), infinity]).amin()  # []
    highest = torch.cat([torch.where(valid, ratio, -infinity).flatten(), -infinity]).amax()  # []
    return {
        "ratio_mean": torch.where(any_valid, mean_over_valid(ratio, valid), one),
        "ratio_min": torch.where(any_valid, lowest, one),
        "ratio_max": torch.where(any_valid, highest, one),
    }


def surrogate_stats(
    clipped_low_tokens: Tensor,
    clipped_high_tokens: Tensor,
    lengths: Tensor,
    ratio: Tensor,
    ratio_valid: Tensor,
    log_ratio: Tensor,
    valid: Tensor,
) -> dict[str, Tensor]:
    """What every clipped objective reports, detached float32: ``clip_frac`` (and ``_low`` / ``_high``: response
    tokens whose gradient the clip removes, over all response tokens), ``ratio_mean/min/max`` (of ``ratio`` where
    ``ratio_valid``), ``seq_log_ratio_abs_mean`` (mean |log s_i| over valid responses) and ``num_empty``.

    Args:
        clipped_low_tokens, clipped_high_tokens: [] counts of clipped response tokens on each side.
        lengths: [N] response lengths.
        ratio, ratio_valid: the objective's ratio ([N] or [N, T]) and where it is defined.
        log_ratio: [N] each response's length-normalised log-ratio (GSPO's log s_i).
        valid: [N] responses with tokens.
    """
    stats = clip_fraction_stats(clipped_low_tokens, clipped_high_tokens, lengths.sum())
    stats.update(ratio_stats(ratio, ratio_valid))
    stats["seq_log_ratio_abs_mean"] = mean_over_valid(log_ratio.detach().abs(), valid)
    stats["num_empty"] = (~valid).sum().float()
    return {name: value.detach().float() for name, value in stats.items()}


def reference_token_terms(logprobs, old_logprobs, advantages, mask, term) -> list[list[Tensor]]:
    """For the loop-by-loop references: ``term(ratio, advantage, logprob)`` of every response token, one float64
    value at a time, as ``[[term, ...], ...]`` per response (padding skipped). ``advantages`` is [N] or [N, T]."""
    rows = []
    for i in range(len(logprobs)):
        terms = []
        for t in range(logprobs.shape[1]):
            if mask[i, t] == 0:
                continue
            ratio = torch.exp(logprobs[i, t].double() - old_logprobs[i, t].double())
            advantage = (advantages[i, t] if advantages.dim() == 2 else advantages[i]).double()
            terms.append(term(ratio, advantage, logprobs[i, t].double()))
        rows.append(terms)
    return rows


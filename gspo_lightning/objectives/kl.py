"""Per-token estimates of KL(pi_theta || pi_ref), the optional penalty to a reference policy.

The GSPO paper drops this term ("not the focus of this paper"); frameworks keep it optional and off by default.
The estimators are Schulman's ("Approximating KL Divergence", 2020), evaluated on tokens sampled from the
rollout policy, with ``d = log pi_ref - log pi_theta``:

- ``k1 = -d = log pi_theta - log pi_ref``: unbiased, high variance, can be negative;
- ``k3 = exp(d) - d - 1``: unbiased, lower variance, always >= 0 (GRPO's penalty).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from gspo_lightning.objectives.clipping import MAX_EXP_LOG_RATIO

KLEstimator = Literal["k1", "k3"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k3")


def k3_from_log_ratio(ref_minus_policy: Tensor) -> Tensor:
    """``exp(d) - d - 1`` as ``expm1(d) - d`` (no cancellation near d = 0, so never below 0), elementwise.

    Above ``d = MAX_EXP_LOG_RATIO`` (20) it continues along its tangent, like the policy ratios
    (``exp_with_linear_tail``): value and gradient stay finite (and >= 0) where exp would overflow, and the
    gradient keeps its sign instead of being dropped. At or below 20 it is exact.
    """
    above = ref_minus_policy > MAX_EXP_LOG_RATIO  # d's shape
    capped = torch.where(above, torch.full_like(ref_minus_policy, MAX_EXP_LOG_RATIO), ref_minus_policy)  # d's shape
    exact = torch.expm1(capped) - capped  # d's shape
    at_cap = math.expm1(MAX_EXP_LOG_RATIO) - MAX_EXP_LOG_RATIO
    tangent = at_cap + math.expm1(MAX_EXP_LOG_RATIO) * (ref_minus_policy - MAX_EXP_LOG_RATIO)  # d's shape
    return torch.where(above, tangent, exact)  # d's shape


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: KLEstimator) -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref), [N, T] float32, exactly 0 on padding.

    Args:
        logprobs: [N, T] log-probabilities of the sampled tokens under the current policy (differentiated).
        ref_logprobs: [N, T] the same under the frozen reference policy (detached).
        mask: [N, T] nonzero on response tokens (bool, int or float).
        estimator: ``"k1"`` (``logprobs - ref_logprobs``) or ``"k3"`` (``exp(ref - logp) - (ref - logp) - 1``).

    Computed in float32. Padding is selected away with ``torch.where`` before any arithmetic that could turn a
    NaN/inf there into a NaN gradient, so it contributes nothing to the value or the gradient.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {', '.join(KL_ESTIMATORS)}, got estimator={estimator!r}")
    if logprobs.dim() != 2 or ref_logprobs.shape != logprobs.shape or mask.shape != logprobs.shape:
        raise ValueError(
            "logprobs, ref_logprobs and mask must all be [N, T], got "
            f"{tuple(logprobs.shape)}, {tuple(ref_logprobs.shape)} and {tuple(mask.shape)}"
        )
    token_mask = mask != 0  # [N, T]
    difference = ref_logprobs.detach().float() - logprobs.float()  # [N, T]
    ref_minus_policy = torch.where(token_mask, difference, torch.zeros_like(difference))  # [N, T], 0 on padding
    estimate = -ref_minus_policy if estimator == "k1" else k3_from_log_ratio(ref_minus_policy)  # [N, T]
    return torch.where(token_mask, estimate, torch.zeros_like(estimate))  # [N, T]

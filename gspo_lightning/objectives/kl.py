"""Per-token KL estimators to a reference policy, as a loss term or as a reward penalty.

The GSPO paper drops the KL term ("not the focus of this paper"); frameworks keep it optional and off by default.
The estimators are Schulman's ("Approximating KL Divergence", 2020), evaluated on tokens y sampled from the
rollout policy, with ``log r = log pi_theta(y) - log pi_ref(y)`` and ``d = -log r``:

- ``k1 = log r``: an unbiased estimate of KL(pi_theta || pi_ref)'s *value*, but as a loss term its expected
  gradient is 0 on on-policy samples (E[grad log pi_theta] = 0): it only adds noise and never pulls towards
  the reference. It is offered as a reward penalty only (``kl_in="reward"``), where it enters the
  score-function gradient and does regularise.
- ``k2 = 1/2 (log r)^2``: as a loss term its on-policy expected gradient is exactly grad KL(pi_theta || pi_ref)
  (E[log r * grad log pi_theta] = sum_y grad pi_theta(y) log r(y)).
- ``k3 = exp(d) - d - 1 = pi_ref / pi_theta - log(pi_ref / pi_theta) - 1``: unbiased for KL(pi_theta || pi_ref)'s
  value and always >= 0 (GRPO's penalty), but as a loss term its on-policy expected gradient is that of
  KL(pi_ref || pi_theta), the *reverse* divergence (E[(1 - pi_ref / pi_theta) grad log pi_theta] =
  -sum_y pi_ref(y) grad log pi_theta(y)). Both divergences are 0 exactly at pi_theta = pi_ref.

``tests/objectives/test_kl.py`` enumerates a small vocabulary to check each of these expected gradients exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from gspo_lightning.objectives.clipping import MAX_EXP_LOG_RATIO

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
LOSS_KL_ESTIMATORS: tuple[str, ...] = ("k2", "k3")
"""The estimators whose gradient regularises as a loss term (k1's expected gradient is 0 there)."""
KLPlacement = Literal["loss", "reward"]
KL_PLACEMENTS: tuple[str, ...] = ("loss", "reward")


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
    """Per-token KL estimate ``estimator`` of pi_theta against pi_ref, [N, T] float32, exactly 0 on padding.

    Args:
        logprobs: [N, T] log-probabilities of the sampled tokens under the current policy (differentiated).
        ref_logprobs: [N, T] the same under the frozen reference policy (detached).
        mask: [N, T] nonzero on response tokens (bool, int or float).
        estimator: ``"k1"`` (``log r``), ``"k2"`` (``(log r)^2 / 2``) or ``"k3"`` (``exp(d) - d - 1``, d = -log r);
            see the module docstring for which divergence each one's gradient follows.

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
    if estimator == "k1":
        estimate = -ref_minus_policy  # [N, T]
    elif estimator == "k2":
        estimate = 0.5 * ref_minus_policy.square()  # [N, T]
    else:
        estimate = k3_from_log_ratio(ref_minus_policy)  # [N, T]
    return torch.where(token_mask, estimate, torch.zeros_like(estimate))  # [N, T]


@dataclass(frozen=True)
class KLRewardPenalty:
    """A KL penalty subtracted from each response's reward before its advantage is computed (``kl_in="reward"``).

    Attributes:
        coef: beta, the penalty's weight (> 0).
        estimator: the per-token estimate summed over the response (``k1``, the usual choice, ``k2`` or ``k3``).
    """

    coef: float
    estimator: KLEstimator = "k1"


def kl_reward_penalty(old_logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: KLEstimator) -> Tensor:
    """The sequence-level KL estimate of each response, summed over its tokens: [N] float32.

    With ``k1`` this is ``log pi_old(y|x) - log pi_ref(y|x)``, an unbiased estimate of
    KL(pi_old(.|x) || pi_ref(.|x)) for the sampled response. Subtracted from the reward (``r - beta * kl``) it
    enters the policy gradient through the advantage, whose expected gradient is then
    -beta * grad KL(pi_theta || pi_ref) at pi_theta = pi_old: the penalty regularises even with k1.

    Args:
        old_logprobs: [N, T] log-probs of the sampling policy (pi_old), detached.
        ref_logprobs: [N, T] log-probs of the reference policy.
        mask: [N, T] nonzero on response tokens.
        estimator: the per-token estimator (see :func:`kl_penalty`).
    """
    return kl_penalty(old_logprobs.detach(), ref_logprobs, mask, estimator).sum(-1)  # [N]


def kl_penalised_rewards(
    rewards: Tensor, old_logprobs: Tensor, ref_logprobs: Tensor, response_mask: Tensor, penalty: KLRewardPenalty
) -> tuple[Tensor, Tensor]:
    """``r - beta * KL`` per response (``kl_in="reward"``), and the KL estimates themselves.

    Args:
        rewards: [N] combined rewards (NaN where unavailable: it stays NaN and its group stays skipped).
        old_logprobs: [N, R] pi_old's log-probs of the sampled tokens.
        ref_logprobs: [N, R] pi_ref's.
        response_mask: [N, R].
        penalty: the coefficient and the per-token estimator (see ``kl_reward_penalty``).
    Returns:
        penalised rewards [N] float32 and the summed KL estimate of each response [N] float32.
    """
    kl = kl_reward_penalty(old_logprobs, ref_logprobs, response_mask, penalty.estimator)  # [N]
    return rewards.float().to(kl.device) - penalty.coef * kl, kl

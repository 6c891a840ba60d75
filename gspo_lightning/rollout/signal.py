"""Which groups of a rollout batch carry a learning signal, and their advantages (pure functions).

A group is skipped when any of its responses has no reward (a reward function failed for it under
``reward_errors="skip"``: its reward is NaN) or its prompt was skipped (``prompt_overflow="skip"``). A skipped
group gets advantages 0 for all its responses: nothing is imputed, so it neither pushes nor pulls the policy.
The other groups' advantages are computed as if the skipped groups were not there (the ``batch`` std included).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gspo_lightning.objectives import AdvantageScale, KLRewardPenalty, group_advantages, kl_reward_penalty


def skipped_responses(rewards: Tensor, prompt_skipped: Tensor | None, group_size: int) -> Tensor:
    """[N] bool, True for every response of a group with a NaN reward or a skipped prompt.

    Args:
        rewards: [N] rewards, NaN where unavailable; groups contiguous.
        prompt_skipped: [N] bool (each prompt's flag repeated over its group), or None.
        group_size: G.
    """
    bad = rewards.isnan().view(-1, group_size)  # [P, G]
    if prompt_skipped is not None:
        bad = bad | prompt_skipped.to(bad.device).view(-1, group_size)  # [P, G]
    return bad.any(-1, keepdim=True).expand(-1, group_size).reshape(-1)  # [N]


def advantages_with_skips(rewards: Tensor, skipped: Tensor, group_size: int, scale: AdvantageScale) -> Tensor:
    """``group_advantages`` (Eq. 6) over the kept groups, exactly 0 for the skipped ones; [N] float32."""
    advantages = torch.zeros(rewards.shape, dtype=torch.float32, device=rewards.device)  # [N]
    kept = ~skipped  # [N] whole groups, so the kept rows stay group-contiguous
    advantages[kept] = group_advantages(rewards[kept], group_size, scale)  # [N_kept]
    return advantages


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

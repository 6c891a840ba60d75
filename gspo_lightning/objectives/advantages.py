"""Group-normalised advantages (GSPO paper Eq. 6, the same as GRPO's) and the batch-std / no-std variants.

A group is skipped when any of its responses has no reward (a reward function failed for it under
``reward_errors="skip"``: its reward is NaN) or its prompt was skipped (``prompt_overflow="skip"``). A skipped
group gets advantages 0 for all its responses: nothing is imputed, so it neither pushes nor pulls the policy.
The other groups' advantages are computed as if the skipped groups were not there (the ``batch`` std included).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

AdvantageScale = Literal["group", "batch", "none"]
ADVANTAGE_SCALES: tuple[str, ...] = ("group", "batch", "none")

# A group's std at or below this fraction of its largest |reward| is rounding noise around equal rewards
# (float32 means of equal values such as 0.1 are not always exact), not a real spread.
ZERO_STD_RELATIVE_TOLERANCE = 1e-6


def group_advantages(rewards: Tensor, group_size: int, scale: AdvantageScale = "group") -> Tensor:
    """``A_i = (r_i - mean_group(r)) / scale`` for every response (Eq. 6 with the default ``scale="group"``).

    Args:
        rewards: [N] rewards, ``N = P * group_size``, groups contiguous (row ``i`` belongs to group
            ``i // group_size``).
        group_size: G, the number of responses sampled per prompt (>= 2).
        scale: what the group-centred rewards are divided by:
            ``"group"``: the group's std (Eq. 6, GRPO and GSPO);
            ``"batch"``: the std of all N rewards (group mean, batch std; more robust when a group's std is
            tiny); all N rewards equal gives advantages 0;
            ``"none"``: nothing, only the group mean is subtracted (Dr. GRPO, Liu et al., 2025, arXiv
            2503.20783, which argues the std division biases towards too easy and too hard prompts).

    Returns:
        [N] float32 advantages, computed in float32 whatever the input dtype.

    Every std is ``torch.std`` with Bessel's correction (unbiased, divide by count - 1), as TRL and verl do. A
    group whose rewards are all equal (std 0, or below ``ZERO_STD_RELATIVE_TOLERANCE`` times its largest
    |reward|) carries no learning signal: its advantages are exactly 0, never NaN, whatever the scale. No
    epsilon is added to a std, so every other advantage is exact.
    """
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 to normalise within a group, got group_size={group_size}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [N], got shape {tuple(rewards.shape)}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"the number of rewards N={rewards.numel()} is not a multiple of group_size={group_size}"
        )
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"scale must be one of {', '.join(ADVANTAGE_SCALES)}, got scale={scale!r}")
    grouped = rewards.detach().float().reshape(-1, group_size)  # [P, G]
    if grouped.numel() == 0:
        return grouped.reshape(-1)  # [0]
    mean, denominator, no_signal = group_normaliser(grouped, scale)  # [P, 1], [P|1, 1], [P, 1]
    advantages = torch.where(no_signal, torch.zeros_like(grouped), (grouped - mean) / denominator)  # [P, G]
    return advantages.reshape(-1)  # [N]


def group_normaliser(grouped: Tensor, scale: AdvantageScale) -> tuple[Tensor, Tensor, Tensor]:
    """Eq. 6's centre and scale of [P, G] float32 rewards: the group means [P, 1], the denominators [P, 1] or
    [1, 1] (1 where there is no signal, so no NaN reaches even a discarded branch) and which groups carry no
    signal [P, 1] (equal rewards, or a zero denominator)."""
    _, zero_variance = spread(grouped)  # [P, 1]
    denominator, zero_denominator = _DENOMINATORS[scale](grouped)  # [P, 1] or [1, 1] each
    safe_denominator = torch.where(zero_denominator, torch.ones_like(denominator), denominator)  # [P|1, 1]
    return grouped.mean(dim=1, keepdim=True), safe_denominator, zero_variance | zero_denominator


def spread(values: Tensor) -> tuple[Tensor, Tensor]:
    """Bessel-corrected std along the last dim (keepdim) and whether it is only rounding noise (counts as 0)."""
    std = values.std(dim=-1, unbiased=True, keepdim=True)  # [..., 1]
    largest = values.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    return std, std <= ZERO_STD_RELATIVE_TOLERANCE * largest  # [..., 1] each


def _no_scale(grouped: Tensor) -> tuple[Tensor, Tensor]:
    """Denominator 1, never zero (Dr. GRPO)."""
    one = torch.ones((1, 1), dtype=grouped.dtype, device=grouped.device)  # [1, 1]
    return one, torch.zeros((1, 1), dtype=torch.bool, device=grouped.device)  # [1, 1] each


_DENOMINATORS: dict[str, Callable[[Tensor], tuple[Tensor, Tensor]]] = {
    "group": spread,  # [P, G] -> [P, 1]
    "batch": lambda grouped: spread(grouped.reshape(1, -1)),  # [P, G] -> [1, 1]
    "none": _no_scale,
}


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


def turn_advantages(
    turn_rewards: Tensor, turn_index: Tensor, skipped: Tensor, group_size: int, scale: AdvantageScale = "group"
) -> Tensor:
    """Per-turn advantages of multi-turn episodes, one per token: ``A_i,t = (G_i,k - mean_g G_g,0) / scale``.

    ``G_i,k`` is episode i's return from turn k on (the sum of its rewards from turn k, no discount) and ``k`` the
    turn token t belongs to; the centre and scale are Eq. 6's over the group's episode returns ``G_g,0``. A turn's
    tokens are credited with what follows it, not with rewards earned before it (those cannot depend on it, so
    subtracting them is a valid baseline). With all reward at the end every ``G_i,k = G_i,0`` and each token gets
    its episode's advantage (Eq. 6). For GSPO-token (Eqs. 13-17), whose per-token advantages this feeds.

    Args:
        turn_rewards: [N, K] each turn's reward (0 after an episode's last turn), groups contiguous.
        turn_index: [N, T] the turn of each token, -1 where the policy did not write it.
        skipped: [N] bool, responses of skipped groups (their advantages are 0).
        group_size: G.
        scale: as in ``group_advantages``.

    Returns:
        [N, T] float32, 0 on tokens of no turn and in skipped or zero-signal groups.
    """
    rewards = torch.where(skipped[:, None], torch.zeros_like(turn_rewards), turn_rewards).float()  # [N, K]
    returns = rewards.flip(-1).cumsum(-1).flip(-1)  # [N, K] return from turn k on
    advantages = torch.zeros(turn_index.shape, dtype=torch.float32, device=turn_index.device)  # [N, T]
    kept = ~skipped  # [N] whole groups
    if not bool(kept.any()):
        return advantages
    episode = returns[kept, 0].reshape(-1, group_size)  # [P_kept, G]
    mean, denominator, no_signal = group_normaliser(episode, scale)  # [P_kept, 1] x3 (or [1, 1])
    per_turn = (returns[kept].reshape(-1, group_size, returns.shape[1]) - mean[..., None]) / denominator[..., None]
    per_turn = torch.where(no_signal[..., None], torch.zeros_like(per_turn), per_turn)  # [P_kept, G, K]
    per_turn = per_turn.reshape(-1, returns.shape[1])  # [N_kept, K]
    index = turn_index[kept].clamp(min=0)  # [N_kept, T]
    tokens = torch.gather(per_turn.to(index.device), 1, index)  # [N_kept, T]
    advantages[kept] = torch.where(turn_index[kept] >= 0, tokens, torch.zeros_like(tokens))
    return advantages

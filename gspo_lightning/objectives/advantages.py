"""Group-normalised advantages (GSPO paper Eq. 6, the same as GRPO's)."""

from __future__ import annotations

import torch
from torch import Tensor

# A group's std at or below this fraction of its largest |reward| is rounding noise around equal rewards
# (float32 means of equal values such as 0.1 are not always exact), not a real spread.
ZERO_STD_RELATIVE_TOLERANCE = 1e-6


def group_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """``A_i = (r_i - mean_group(r)) / std_group(r)`` for every response (Eq. 6).

    Args:
        rewards: [N] rewards, ``N = P * group_size``, groups contiguous (row ``i`` belongs to group
            ``i // group_size``).
        group_size: G, the number of responses sampled per prompt (>= 2).

    Returns:
        [N] float32 advantages, computed in float32 whatever the input dtype.

    The std is ``torch.std`` with Bessel's correction (unbiased, divide by G - 1), as TRL and verl do. A group
    whose rewards are all equal (std 0, or below ``ZERO_STD_RELATIVE_TOLERANCE`` times its largest |reward|)
    carries no learning signal: its advantages are exactly 0, never NaN. No epsilon is added to the std, so
    every other group's advantages are exact.
    """
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 to normalise within a group, got group_size={group_size}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [N], got shape {tuple(rewards.shape)}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"the number of rewards N={rewards.numel()} is not a multiple of group_size={group_size}"
        )
    grouped = rewards.detach().float().reshape(-1, group_size)  # [P, G]
    mean = grouped.mean(dim=1, keepdim=True)  # [P, 1]
    std = grouped.std(dim=1, unbiased=True, keepdim=True)  # [P, 1]
    scale = grouped.abs().amax(dim=1, keepdim=True)  # [P, 1]
    zero_variance = std <= ZERO_STD_RELATIVE_TOLERANCE * scale  # [P, 1]
    # Dividing by 1 in degenerate groups keeps NaN out even of the branch that `where` discards.
    safe_std = torch.where(zero_variance, torch.ones_like(std), std)  # [P, 1]
    advantages = torch.where(zero_variance, torch.zeros_like(grouped), (grouped - mean) / safe_std)  # [P, G]
    return advantages.reshape(-1)  # [N]

"""Summary statistics of a rollout batch (pure; the sampler logs them)."""

from __future__ import annotations

from torch import Tensor

from gspo_lightning.rollout.types import Rollout


def zero_variance_fraction(rewards: Tensor, group_size: int) -> Tensor:
    """Fraction of groups whose G rewards are all equal: they carry no learning signal (Eq. 6)."""
    grouped = rewards.view(-1, group_size)  # [P, G]
    return (grouped.max(-1).values == grouped.min(-1).values).float().mean()


def rollout_stats(rollout: Rollout, group_size: int) -> dict[str, Tensor]:
    """Reward, length and truncation figures of one rollout batch, as float32 scalars."""
    lengths = rollout.response_mask.sum(-1).float()  # [N]
    stats = {
        "reward_mean": rollout.rewards.mean(),
        "reward_std": rollout.rewards.std(),
        "zero_variance_frac": zero_variance_fraction(rollout.rewards, group_size),
        "response_len_mean": lengths.mean(),
        "response_len_max": lengths.max(),
        "truncated_frac": rollout.truncated.float().mean(),
    }
    for name, scores in rollout.reward_components.items():
        stats[f"reward/{name}"] = scores.mean()
    return {key: value.detach().float().cpu() for key, value in stats.items()}

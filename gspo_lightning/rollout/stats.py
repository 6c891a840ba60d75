"""Summary statistics of a rollout batch (pure; the sampler logs them)."""

from __future__ import annotations

import torch
from torch import Tensor

from gspo_lightning.objectives.advantages import skipped_responses
from gspo_lightning.rollout.types import EpisodeCounts, Rollout


def zero_variance_fraction(rewards: Tensor, group_size: int) -> Tensor:
    """Fraction of groups whose G rewards are all equal: they carry no learning signal (Eq. 6). A group with a NaN
    reward (a failed reward function) does not count: it is counted as skipped instead."""
    grouped = rewards.view(-1, group_size)  # [P, G]
    return (grouped.max(-1).values == grouped.min(-1).values).float().mean()


def _groups(flags: Tensor | None, group_size: int) -> Tensor:
    """Number of groups with any flag set (0 when ``flags`` is None)."""
    if flags is None:
        return torch.tensor(0.0)
    return flags.view(-1, group_size).any(-1).sum().float()


def _std(values: Tensor) -> Tensor:
    return values.std() if values.numel() > 1 else torch.tensor(float("nan"))


def rollout_stats(rollout: Rollout, group_size: int) -> dict[str, Tensor]:
    """Reward, length, truncation and skip figures of one rollout batch, as float32 scalars.

    Rewards that are unavailable (NaN) are left out of the reward figures; ``reward_mean`` is NaN only when no
    sample has a reward. ``reward_errors`` counts those samples; ``groups_skipped`` the groups left out of
    learning (reward errors and skipped prompts); ``prompts_truncated`` the prompts cut to fit the context
    (skipped ones included); ``prompts_skipped`` those of them left out of learning; ``no_signal`` is 1.0 when
    no response of the batch has a non-zero advantage (every group zero-variance or skipped), else 0.0.
    """
    lengths = rollout.response_mask.sum(-1).float()  # [N]
    rewards = rollout.rewards.float()  # [N]
    scored = ~rewards.isnan()  # [N]
    skipped = skipped_responses(rewards, rollout.prompt_skipped, group_size)  # [N]
    stats = {
        "reward_mean": rewards.nanmean(),
        "reward_std": _std(rewards[scored]),
        "zero_variance_frac": zero_variance_fraction(rewards, group_size),
        "response_len_mean": lengths.mean(),
        "response_len_max": lengths.max(),
        "truncated_frac": rollout.truncated.float().mean(),
        "reward_errors": (~scored).sum().float(),
        "groups_skipped": _groups(skipped, group_size),
        "prompts_truncated": _groups(rollout.prompt_cut, group_size),
        "prompts_skipped": _groups(rollout.prompt_skipped, group_size),
        "no_signal": (rollout.advantages == 0).all().float(),
    }
    if rollout.kl_penalties is not None:  # kl_in="reward": the estimate subtracted (times beta) from the rewards
        stats["kl_penalty_mean"] = rollout.kl_penalties.float().mean()
    for name, scores in rollout.reward_components.items():
        stats[f"reward/{name}"] = scores.float().nanmean()
    if rollout.episodes is not None:
        stats |= episode_stats(rollout.episodes)
    return {key: value.detach().float().cpu() for key, value in stats.items()}


def episode_stats(counts: EpisodeCounts) -> dict[str, Tensor]:
    """Means per episode of its turns, tool calls, tool errors, policy and context tokens; the fraction of
    episodes each limit stopped (``truncated_by_*``) and the number whose environment or a tool failed."""
    return {
        "turns_mean": counts.turns.float().mean(),
        "turns_max": counts.turns.float().max(),
        "tool_calls_mean": counts.tool_calls.float().mean(),
        "tool_errors_mean": counts.tool_errors.float().mean(),
        "policy_tokens_mean": counts.policy_tokens.float().mean(),
        "context_tokens_mean": counts.context_tokens.float().mean(),
        "truncated_by_max_turns": counts.truncated_turns.float().mean(),
        "truncated_by_max_new_tokens": counts.truncated_turn_tokens.float().mean(),
        "truncated_by_max_episode_tokens": counts.truncated_context.float().mean(),
        "episodes_failed": counts.failed.float().sum(),
    }

"""What reward functions see of an episode: its final answer as the completion, and two extra columns."""

from __future__ import annotations

from typing import Any

ENVIRONMENT_REWARD = "environment_reward"
"""Column holding each episode's environment reward (the sum of its turns')."""
EPISODE_MESSAGES = "episode_messages"
"""Column holding each episode's whole conversation (chat messages)."""


def environment_reward(prompts: list[Any], completions: list[str], **columns: list[Any]) -> list[float]:
    """The environment's reward of each episode (the sum of its turns'): list it in ``sampler.rewards`` to train
    on it, weighted with ``reward_weights`` like any reward function."""
    if ENVIRONMENT_REWARD not in columns:
        raise KeyError("environment_reward scores episodes: it needs sampler.episodes")
    return [float(value) for value in columns[ENVIRONMENT_REWARD]]

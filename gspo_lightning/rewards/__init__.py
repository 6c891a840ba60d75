"""Reward functions: plain callables ``(prompts, completions, **columns) -> list[float]``."""

from gspo_lightning.rewards.answers import ExactAnswer
from gspo_lightning.rewards.countdown import CountdownAnswer
from gspo_lightning.rewards.isolation import RewardRunner
from gspo_lightning.rewards.scoring import RewardFunction, reward_name, score_completions
from gspo_lightning.rewards.shaping import FormatReward, LengthPenalty

__all__ = [
    "CountdownAnswer",
    "ExactAnswer",
    "FormatReward",
    "LengthPenalty",
    "RewardFunction",
    "RewardRunner",
    "reward_name",
    "score_completions",
]

"""Reward functions: plain callables ``(prompts, completions, **columns) -> list[float]``."""

from gspo_lightning.rewards.answers import ExactAnswer, FinalAnswer
from gspo_lightning.rewards.code import CodeTests
from gspo_lightning.rewards.countdown import CountdownAnswer
from gspo_lightning.rewards.isolation import RewardRunner
from gspo_lightning.rewards.math import MathAnswer
from gspo_lightning.rewards.scoring import RewardFunction, reward_name, score_completions
from gspo_lightning.rewards.shaping import FormatReward, LengthPenalty

__all__ = [
    "CodeTests",
    "CountdownAnswer",
    "ExactAnswer",
    "FinalAnswer",
    "FormatReward",
    "LengthPenalty",
    "MathAnswer",
    "RewardFunction",
    "RewardRunner",
    "reward_name",
    "score_completions",
]

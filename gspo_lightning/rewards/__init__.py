"""Reward functions: plain callables ``(prompts, completions, **columns) -> list[float]``."""

from gspo_lightning.rewards.answers import ExactAnswer
from gspo_lightning.rewards.isolation import RewardRunner
from gspo_lightning.rewards.scoring import RewardFunction, reward_name, score_completions

__all__ = ["ExactAnswer", "RewardFunction", "RewardRunner", "reward_name", "score_completions"]

"""Reward functions: plain callables ``(prompts, completions, **columns) -> list[float]``."""

from gspo_lightning.rewards.answers import ExactAnswer
from gspo_lightning.rewards.scoring import RewardFunction, reward_name, score_completions

__all__ = ["ExactAnswer", "RewardFunction", "reward_name", "score_completions"]

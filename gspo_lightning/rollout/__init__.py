"""Sampling and scoring: from prompts to the minibatches the objective trains on."""

from gspo_lightning.rollout.evaluation import HeldOutEvaluation
from gspo_lightning.rollout.sampler import GroupSampler
from gspo_lightning.rollout.types import Minibatch, PromptBatch, Rollout

__all__ = ["GroupSampler", "HeldOutEvaluation", "Minibatch", "PromptBatch", "Rollout"]

"""gspo_lightning: Group Sequence Policy Optimization (arXiv 2507.18071) on PyTorch Lightning."""

from gspo_lightning.callbacks import ExportPolicy
from gspo_lightning.module import GSPOModule
from gspo_lightning.rollout import Minibatch, PromptBatch, Rollout
from gspo_lightning.sampling import GroupSampler, HeldOutEvaluation

__version__ = "0.1.0"
__all__ = [
    "ExportPolicy",
    "GSPOModule",
    "GroupSampler",
    "HeldOutEvaluation",
    "Minibatch",
    "PromptBatch",
    "Rollout",
]

"""Evaluation metrics: the unbiased pass@k estimator and its torchmetrics accumulator."""

from gspo_lightning.metrics.pass_at_k import PassAtK, pass_at_k

__all__ = ["PassAtK", "pass_at_k"]

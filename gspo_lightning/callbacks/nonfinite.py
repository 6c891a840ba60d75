"""NonFiniteGuard: a non-finite loss or gradient never reaches the weights."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from gspo_lightning.callbacks.emergency import save_emergency_checkpoint
from gspo_lightning.metric_logging import log_across_ranks
from gspo_lightning.validation import require


class NonFiniteGuard(Callback):
    """Skips optimizer steps whose gradient is not finite, counts them, and stops a run that keeps producing them.

    A step is bad when ``training_step`` returned no loss, when the LightningModule says it skips the update
    (``GSPOModule.skips_update``: some rank's loss was NaN/inf, decided on every rank alike) or when any gradient
    is NaN/inf: then every gradient is dropped before the optimizer sees it (AdamW leaves a parameter without
    gradient untouched), on all ranks alike. ``faults/skipped_steps`` and
    ``faults/consecutive_bad_steps`` are logged. After ``max_consecutive_bad_steps`` bad steps in a row the run
    saves ``nonfinite-stop.ckpt`` and stops with an error.

    Args:
        max_consecutive_bad_steps: stop after this many bad steps in a row (>= 1).
    """

    def __init__(self, max_consecutive_bad_steps: int = 10) -> None:
        require(
            max_consecutive_bad_steps >= 1,
            f"nonfinite.max_consecutive_bad_steps must be >= 1, got {max_consecutive_bad_steps}",
        )
        self.max_consecutive_bad_steps = max_consecutive_bad_steps
        self.skipped_steps = 0
        self.consecutive_bad_steps = 0
        self._gradient_dropped = False

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        norm = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
        # Sharded gradients: if any rank saw a bad shard, every rank skips, so the replicas stay equal.
        self._gradient_dropped = trainer.strategy.reduce_boolean_decision(not bool(torch.isfinite(norm)), all=False)
        if self._gradient_dropped:
            for parameter in parameters:
                parameter.grad = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Lightning hands on {"loss": None} (or nothing) when training_step returned no loss.
        no_loss = outputs is None or (isinstance(outputs, dict) and outputs.get("loss") is None)
        bad = no_loss or self._gradient_dropped or bool(getattr(pl_module, "skips_update", False))
        self._gradient_dropped = False
        self.skipped_steps += int(bad)
        self.consecutive_bad_steps = self.consecutive_bad_steps + 1 if bad else 0
        counts = {"faults/skipped_steps": self.skipped_steps, "faults/consecutive_bad_steps": self.consecutive_bad_steps}
        log_across_ranks(pl_module, counts)
        if self.consecutive_bad_steps >= self.max_consecutive_bad_steps:
            path = save_emergency_checkpoint(trainer, "nonfinite-stop")
            raise RuntimeError(
                f"{self.consecutive_bad_steps} consecutive steps had a non-finite loss or gradient "
                f"(nonfinite.max_consecutive_bad_steps={self.max_consecutive_bad_steps}); the weights were never "
                f"updated with them. State saved to {path}. Lower the learning rate or check the rewards and "
                "the data, then resume with --ckpt_path."
            )

    def state_dict(self) -> dict[str, int]:
        return {"skipped_steps": self.skipped_steps, "consecutive_bad_steps": self.consecutive_bad_steps}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.skipped_steps = state_dict["skipped_steps"]
        self.consecutive_bad_steps = state_dict["consecutive_bad_steps"]

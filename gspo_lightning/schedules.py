"""Learning-rate schedules counted in optimizer steps, for ``--lr_scheduler`` (the module steps them every step).

Any ``torch.optim.lr_scheduler`` class works there too (``CosineAnnealingLR``, ``LinearLR``, ...); these add the
warm-up RL fine-tuning recipes use, which torch offers only by chaining schedulers (``SequentialLR``), something a
config cannot write.

    lr_scheduler:
      class_path: gspo_lightning.schedules.CosineWithWarmup
      init_args: {warmup_steps: 10, total_steps: 1000, min_factor: 0.1}
"""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from gspo_lightning.validation import require


class LinearWarmup(LRScheduler):
    """The learning rate rises linearly over ``warmup_steps`` optimizer steps, then stays at the configured one:
    step ``s`` (0-based) trains at ``lr * min(1, (s + 1) / warmup_steps)``; 0 warm-up steps is a constant rate.

    Args:
        warmup_steps: optimizer steps of warm-up (>= 0).
    """

    def __init__(self, optimizer: Optimizer, warmup_steps: int = 0, last_epoch: int = -1) -> None:
        require(
            isinstance(warmup_steps, int) and warmup_steps >= 0,
            f"lr_scheduler.init_args.warmup_steps must be an integer >= 0, got {warmup_steps!r}",
        )
        self.warmup_steps = warmup_steps
        super().__init__(optimizer, last_epoch)

    def factor(self, step: int) -> float:
        """The multiple of the configured learning rate at optimizer step ``step``."""
        return min(1.0, (step + 1) / max(self.warmup_steps, 1))

    def get_lr(self) -> list[float]:
        return [base * self.factor(self.last_epoch) for base in self.base_lrs]


class CosineWithWarmup(LinearWarmup):
    """Linear warm-up, then a cosine decay from the configured rate to ``min_factor`` times it at
    ``total_steps``, held there afterwards.

    Args:
        warmup_steps: optimizer steps of warm-up (>= 0).
        total_steps: the step at which the decay ends (> warmup_steps), e.g. ``trainer.max_steps``.
        min_factor: the final rate as a fraction of the configured one, in [0, 1].
    """

    def __init__(
        self, optimizer: Optimizer, warmup_steps: int = 0, total_steps: int = 1000, min_factor: float = 0.0,
        last_epoch: int = -1,
    ) -> None:  # fmt: skip
        require(
            isinstance(total_steps, int) and total_steps > warmup_steps,
            f"lr_scheduler.init_args.total_steps must be an integer > warmup_steps={warmup_steps}, got {total_steps!r}",
        )
        require(0 <= min_factor <= 1, f"lr_scheduler.init_args.min_factor must be in [0, 1], got {min_factor}")
        self.total_steps = total_steps
        self.min_factor = min_factor
        super().__init__(optimizer, warmup_steps, last_epoch)

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return super().factor(step)
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        return self.min_factor + (1 - self.min_factor) * 0.5 * (1 + math.cos(math.pi * progress))

"""Supervised warm start on arithmetic (the quick start's task), so RL starts from a tiny model that is partly
right; the recipe and its cache are ``gspo_lightning.models.warm_start``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from gspo_lightning.data.arithmetic import arithmetic_problems
from gspo_lightning.models.warm_start import SupervisedWarmStart


class WarmStartedTinyQwen3(SupervisedWarmStart):
    """``TinyQwen3`` trained on arithmetic (the quick-start task) until it is partly right.

    A randomly initialised model never answers correctly, so every GSPO group would get the same reward and no
    learning signal. This loader first trains the tiny model on train-side problems until its greedy
    exact-match accuracy reaches ``target_accuracy`` (low enough to leave RL something to improve), and caches
    the result on disk, keyed by a hash of every setting, so later runs and other ranks reuse it.
    """

    task_settings = ("num_digits", "operations")

    def __init__(self, num_digits: int = 3, operations: str = "+", **kwargs: Any) -> None:
        """
        Args:
            num_digits: digits of each operand, as in the RL task.
            operations: arithmetic operations to train on, a string of ``+-*``.
        """
        super().__init__(**kwargs)
        next(arithmetic_problems(1, num_digits, operations))  # validates digits and operations
        self.num_digits = num_digits
        self.operations = operations
        self.check_fits_model()

    def demonstrations(self, count: int, seed: int) -> Iterator[dict[str, str]]:
        return arithmetic_problems(count, self.num_digits, self.operations, seed=seed)

    def is_correct(self, demonstration: dict[str, str], completion: str) -> bool:
        return completion == demonstration["answer"]

    def longest_demonstration(self) -> dict[str, str]:
        widest = "9" * self.num_digits
        # a sum has a carry digit, a difference a sign, a product twice the digits
        answer = max(
            {"+": self.num_digits + 1, "-": self.num_digits + 1, "*": 2 * self.num_digits}[op] for op in self.operations
        )
        return {"question": f"{widest}{self.operations[0]}{widest}", "answer": "9" * answer}

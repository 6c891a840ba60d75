"""Supervised warm start on Countdown, so RL on Countdown can start from a tiny model that is partly right.

The demonstrations are the expressions each target was generated from (one solution among possibly many);
a completion counts as correct when :class:`~gspo_lightning.rewards.CountdownAnswer` accepts it, so any valid
expression does, not only the demonstrated one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from gspo_lightning.data.countdown import countdown_demonstrations
from gspo_lightning.models.loaders import TinyQwen3
from gspo_lightning.models.warm_start import SupervisedWarmStart
from gspo_lightning.rewards.countdown import CountdownAnswer

COUNTDOWN_ALPHABET = "0123456789+-*/=(): "
"""Digits, the four operations, parentheses, and the separators of the default prompt."""


class CountdownWarmStartedTinyQwen3(SupervisedWarmStart):
    """``TinyQwen3`` trained on Countdown demonstrations until ``target_accuracy`` of its greedy answers reach
    the target. Pair it with ``CountdownTask`` of the same ``num_numbers`` / ``max_number`` and the same
    ``prompt_template``; the completion is the bare expression, e.g. ``3 7 5:26=3*7+5``.
    """

    task_settings = ("num_numbers", "max_number")
    answer_characters = "+-*/()"

    def __init__(
        self,
        num_numbers: int = 3,
        max_number: int = 10,
        prompt_template: str = "{numbers}:{target}=",
        base: TinyQwen3 | None = None,
        **kwargs: Any,
    ) -> None:
        """
        Args:
            num_numbers: how many numbers each problem gives, as in the RL task.
            max_number: largest given number, as in the RL task.
            prompt_template: prompt format with ``{numbers}`` and ``{target}`` fields; must match the RL prompts.
            base: the untrained model; ``TinyQwen3(alphabet=COUNTDOWN_ALPHABET)`` when omitted.
        """
        base = base if base is not None else TinyQwen3(alphabet=COUNTDOWN_ALPHABET)
        super().__init__(base=base, prompt_template=prompt_template, **kwargs)
        next(countdown_demonstrations(1, num_numbers, max_number))  # validates the task settings
        self.num_numbers = num_numbers
        self.max_number = max_number
        self.check_fits_model()

    def demonstrations(self, count: int, seed: int) -> Iterator[dict[str, str]]:
        for problem in countdown_demonstrations(count, self.num_numbers, self.max_number, seed=seed):
            yield {"numbers": problem["numbers"], "target": problem["target"], "answer": problem["solution"]}

    def is_correct(self, demonstration: dict[str, str], completion: str) -> bool:
        return CountdownAnswer.score(completion, demonstration["numbers"], demonstration["target"]) == 1.0

    def longest_demonstration(self) -> dict[str, str]:
        widest = str(self.max_number)
        numbers = " ".join([widest] * self.num_numbers)
        # each number once, an operation between two, parentheses around every inner combination
        answer = "(" * (self.num_numbers - 2) + "*".join([widest] * self.num_numbers) + ")" * (self.num_numbers - 2)
        return {"numbers": numbers, "target": str(self.max_number**self.num_numbers), "answer": answer}

"""Supervised warm start on scratchpad addition, so RL on long responses starts from a partly right model.

The demonstrations are the full scratchpads (``ScratchpadAdditionTask``'s ``scratchpad`` column); a completion
counts as correct when its final answer is right (``FinalAnswer``), as RL scores it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from gspo_lightning.data.scratchpad import SCRATCHPAD_ALPHABET, scratchpad_length, scratchpad_problems
from gspo_lightning.models.loaders import TinyQwen3
from gspo_lightning.models.warm_start import SupervisedWarmStart
from gspo_lightning.rewards.answers import FinalAnswer


class ScratchpadWarmStartedTinyQwen3(SupervisedWarmStart):
    """``TinyQwen3`` trained on written-out additions until ``target_accuracy`` of its greedy final answers
    are right. Pair it with ``ScratchpadAdditionTask`` of the same ``num_digits`` and ``prompt_template``."""

    task_settings = ("num_digits",)

    def __init__(self, num_digits: int = 6, base: TinyQwen3 | None = None, **kwargs: Any) -> None:
        """
        Args:
            num_digits: digits of each operand, as in the RL task.
            base: the untrained model; when omitted, ``TinyQwen3`` with the scratchpad's alphabet and room
                for the prompt and the longest response.
        """
        if base is None:
            room = 2 * num_digits + 2 + scratchpad_length(num_digits) + 2  # prompt, longest response, eos, one spare
            base = TinyQwen3(alphabet=SCRATCHPAD_ALPHABET, max_position_embeddings=room)
        super().__init__(base=base, **kwargs)
        next(scratchpad_problems(1, num_digits))  # validates num_digits
        self.num_digits = num_digits
        self.check_fits_model()

    def demonstrations(self, count: int, seed: int) -> Iterator[dict[str, str]]:
        for problem in scratchpad_problems(count, self.num_digits, seed=seed):
            yield {"question": problem["question"], "answer": problem["scratchpad"], "result": problem["answer"]}

    def is_correct(self, demonstration: dict[str, str], completion: str) -> bool:
        return FinalAnswer().final_answer(completion) == demonstration["result"]

    def longest_demonstration(self) -> dict[str, str]:
        widest = "9" * self.num_digits
        return next(scratchpad_problems(1, self.num_digits)) | {
            "question": f"{widest}+{widest}",
            "answer": "9" * scratchpad_length(self.num_digits),
        }

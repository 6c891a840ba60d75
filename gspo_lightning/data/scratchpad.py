"""Long-response arithmetic: multi-digit addition written out digit by digit, with the final answer checked.

The quick-start task's answers are a few tokens long, too short for the paper's arguments about long responses
(token-level noise accumulating over a response; rounding error shrinking like 1/sqrt(|y|)). Here a correct
response is a scratchpad whose length grows like ``1.5 * num_digits**2``: each line rewrites what is left of
the two operands (one digit shorter), the carry and the digits of the result so far, then the last line gives
the answer. For ``482+396=``::

    48+39,0,8;4+3,1,78;+,0,878=878

Rewriting the remaining operands keeps every step local (the next digits to add sit just before ``+`` and
``,``), so a tiny model can learn it; the price is length, which is what this task is for. Correct responses
have 66, 141 and 243 tokens at 5, 8 and 11 digits. Only the text after the last ``=`` is scored
(``FinalAnswer``), as a reasoning task's final answer is.

Problems share the quick start's train / held-out split (a hash of the question), so held-out questions are
never trained on, by the warm start or by RL.
"""

from __future__ import annotations

from collections.abc import Iterator

from gspo_lightning.data.arithmetic import arithmetic_problems
from gspo_lightning.data.sources import GeneratedTask

SCRATCHPAD_ALPHABET = "0123456789+=,;"
"""Digits, the prompt's ``+`` and ``=``, and the scratchpad's field (``,``) and line (``;``) separators."""


def addition_scratchpad(a: str, b: str) -> str:
    """The written-out sum of the digit strings ``a`` and ``b`` (equal lengths), ending in ``=<a+b>``."""
    if len(a) != len(b) or not (a + b).isdigit():
        raise ValueError(f"operands must be digit strings of equal length, got {a!r} and {b!r}")
    lines, carry, result = [], 0, ""
    while a:
        column = int(a[-1]) + int(b[-1]) + carry
        a, b, carry, result = a[:-1], b[:-1], column // 10, str(column % 10) + result
        lines.append(f"{a}+{b},{carry},{result}")
    answer = (str(carry) if carry else "") + result
    return ";".join(lines) + f"={answer}"


def scratchpad_length(num_digits: int) -> int:
    """Characters (tokens, with the character tokenizer) of the longest correct response at ``num_digits``
    digits (``9...9+9...9``, whose final carry makes the answer one digit longer), not counting the eos token."""
    widest = "9" * num_digits
    return len(addition_scratchpad(widest, widest))


def scratchpad_problems(count: int, num_digits: int, seed: int = 0, heldout: bool = False) -> Iterator[dict[str, str]]:
    """Yield ``count`` problems ``{"question": "482+396", "answer": "878", "scratchpad": "48+39,0,8;..."}``."""
    for problem in arithmetic_problems(count, num_digits, "+", seed=seed, heldout=heldout):
        a, b = problem["question"].split("+")
        yield problem | {"scratchpad": addition_scratchpad(a, b)}


class ScratchpadAdditionTask(GeneratedTask):
    """Generated additions to be worked digit by digit (columns ``question``, ``answer`` and ``scratchpad``);
    score with ``FinalAnswer``. Pair it with ``ScratchpadWarmStartedTinyQwen3`` of the same ``num_digits``."""

    def __init__(self, num_digits: int = 6, train_size: int = 20000, eval_size: int = 256, seed: int = 0) -> None:
        """
        Args:
            num_digits: Digits of each operand; a correct response has ``scratchpad_length(num_digits)``
                tokens (66 at 5 digits, 141 at 8).
            train_size: Number of training problems.
            eval_size: Number of held-out problems; drawn from a fixed 1/32 of all questions that training
                never sees, whatever the seed.
            seed: Seed of the problem generator.
        """
        if num_digits < 3:
            raise ValueError(
                f"num_digits must be >= 3 (a response of a few tokens is the quick start), got {num_digits}"
            )
        super().__init__(train_size, eval_size, seed)
        self.num_digits = num_digits

    def problems(self, count: int, heldout: bool) -> Iterator[dict[str, str]]:
        return scratchpad_problems(count, self.num_digits, seed=self.seed, heldout=heldout)

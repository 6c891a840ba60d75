"""Countdown: reach a target number from given numbers with ``+ - * /`` and parentheses.

Each given number may be used at most once. A target is made by combining a random subset of the numbers with
random operations (integer intermediate values only, divisions exact), so every problem has a solution.

As in :mod:`gspo_lightning.data.arithmetic`, problems are split into train and held-out by a hash of the
numbers and the target, so every generator draws from a fixed side of the split whatever its seed or size.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterator

from gspo_lightning.data.sources import GeneratedTask

HELDOUT_ONE_IN = 32  # 1/32 of all problems are held out
# Give up after this many draws in a row that land on the wrong side of the split (a degenerate problem space).
_MAX_CONSECUTIVE_REJECTIONS = 100_000


def is_heldout(numbers: str, target: str) -> bool:
    """True for problems reserved for evaluation (a fixed 1/32 of the problem space)."""
    return zlib.crc32(f"{numbers}={target}".encode()) % HELDOUT_ONE_IN == 0


def _combine(rng: random.Random, values: list[int]) -> tuple[int, str] | None:
    """Fold ``values`` into one integer with random operations: ``(value, expression)``, or None where a draw is
    not allowed. The expression uses each value once and evaluates exactly to the value."""
    pool = [(value, str(value)) for value in values]
    while len(pool) > 1:
        (a, left), (b, right) = pool.pop(rng.randrange(len(pool))), pool.pop(rng.randrange(len(pool)))
        op = rng.choice("+-*/")
        if op == "+":
            value = a + b
        elif op == "-":
            value = a - b
        elif op == "*":
            value = a * b
        else:
            if b == 0 or a % b != 0:
                return None
            value = a // b
        pool.append((value, f"({left}{op}{right})"))
    value, expression = pool[0]
    return value, expression[1:-1]  # at least two values were combined: drop the outermost parentheses


def countdown_problems(
    count: int, num_numbers: int = 4, max_number: int = 100, seed: int = 0, heldout: bool = False
) -> Iterator[dict[str, str]]:
    """Yield ``count`` problems ``{"numbers": "3 7 25 50", "target": "..."}`` from one side of the split.

    The ``num_numbers`` numbers are drawn from 1..``max_number``; the target is a positive integer obtained by
    combining at least two of them, each at most once, with ``+ - * /`` (exact divisions only) and differs
    from every given number.
    """
    for problem in countdown_demonstrations(count, num_numbers, max_number, seed, heldout):
        del problem["solution"]
        yield problem


def countdown_demonstrations(
    count: int, num_numbers: int = 4, max_number: int = 100, seed: int = 0, heldout: bool = False
) -> Iterator[dict[str, str]]:
    """The problems of :func:`countdown_problems` (same seed, same problems), each with the ``"solution"``
    expression its target was made from, e.g. ``{"numbers": "3 7 25 50", "target": "75", "solution": "(50-25)*3"}``.

    For supervised demonstrations (a warm start); one solution among possibly many.
    """
    if num_numbers < 2:
        raise ValueError(f"num_numbers must be >= 2, got {num_numbers}")
    if max_number < 2:
        raise ValueError(f"max_number must be >= 2, got {max_number}")
    rng = random.Random(seed)
    produced = rejected = 0
    while produced < count:
        numbers = [rng.randint(1, max_number) for _ in range(num_numbers)]
        subset = rng.sample(numbers, rng.randint(2, num_numbers))
        combined = _combine(rng, subset)
        accepted = combined is not None and combined[0] > 0 and combined[0] not in numbers
        text = " ".join(map(str, numbers))
        if not accepted or is_heldout(text, str(combined[0])) != heldout:
            rejected += 1
            if rejected > _MAX_CONSECUTIVE_REJECTIONS:
                raise RuntimeError(
                    f"no {'held-out' if heldout else 'training'} problem found in {rejected} draws with "
                    f"num_numbers={num_numbers}, max_number={max_number}; raise them"
                )
            continue
        rejected = 0
        produced += 1
        yield {"numbers": text, "target": str(combined[0]), "solution": combined[1]}


class CountdownTask(GeneratedTask):
    """Generated Countdown problems (columns ``numbers`` and ``target``), scored by ``CountdownAnswer``."""

    def __init__(
        self,
        num_numbers: int = 4,
        max_number: int = 100,
        train_size: int = 20000,
        eval_size: int = 256,
        seed: int = 0,
    ) -> None:
        """
        Args:
            num_numbers: How many numbers each problem gives.
            max_number: Largest given number (numbers are drawn from 1..max_number).
            train_size: Number of training problems.
            eval_size: Number of held-out problems; drawn from a fixed 1/32 of all problems that training
                never sees, whatever the seed.
            seed: Seed of the problem generator.
        """
        super().__init__(train_size, eval_size, seed)
        # Draw one problem of each side so that bad settings fail here, not at load time.
        next(countdown_problems(1, num_numbers=num_numbers, max_number=max_number, seed=seed))
        next(countdown_problems(1, num_numbers=num_numbers, max_number=max_number, seed=seed, heldout=True))
        self.num_numbers = num_numbers
        self.max_number = max_number

    def problems(self, count: int, heldout: bool) -> Iterator[dict[str, str]]:
        return countdown_problems(count, self.num_numbers, self.max_number, seed=self.seed, heldout=heldout)

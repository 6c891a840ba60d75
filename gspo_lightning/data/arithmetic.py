"""Multi-digit arithmetic: the quick-start task with a verifiable answer.

Problems are split into train and held-out by a hash of the question, so every generator (the RL prompt
stream, the supervised warm start, the held-out evaluation) draws from a fixed side of the split whatever its
seed or size: held-out questions are never trained on.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterator

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
HELDOUT_ONE_IN = 32  # 1/32 of all questions are held out


def is_heldout(question: str) -> bool:
    """True for questions reserved for evaluation (a fixed 1/32 of the problem space)."""
    return zlib.crc32(question.encode()) % HELDOUT_ONE_IN == 0


def arithmetic_problems(
    count: int, num_digits: int = 3, operations: str = "+", seed: int = 0, heldout: bool = False
) -> Iterator[dict[str, str]]:
    """Yield ``count`` problems ``{"question": "123+456", "answer": "579"}`` from one side of the split.

    Operands have exactly ``num_digits`` digits; ``operations`` is a string of symbols from ``+-*``.
    """
    if num_digits < 1:
        raise ValueError(f"num_digits must be >= 1, got {num_digits}")
    unknown = set(operations) - set(OPERATIONS)
    if not operations or unknown:
        raise ValueError(f"operations must be a non-empty string of {sorted(OPERATIONS)}, got {operations!r}")
    rng = random.Random(seed)
    low, high = 10 ** (num_digits - 1), 10**num_digits - 1
    produced = 0
    while produced < count:
        a, b, op = rng.randint(low, high), rng.randint(low, high), rng.choice(operations)
        question = f"{a}{op}{b}"
        if is_heldout(question) != heldout:
            continue
        produced += 1
        yield {"question": question, "answer": str(OPERATIONS[op](a, b))}

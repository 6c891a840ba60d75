"""Which weights sample which round: pure functions of round indices.

Version v is the trainer's weights at the start of round v (after v rounds of K optimizer steps). With a fixed
lag k, round r is sampled with version max(r - k, 0): at the start of round r the trainer's weights (version r)
go to the engine for round r + k, and round r trains on what version r - k sampled. Rounds 0 .. k are all sampled
with the initial weights (there are no older ones), at the start of round 0.
"""

from __future__ import annotations


def rounds_to_submit(round_index: int, lag: int) -> list[int]:
    """The rounds whose sampling starts at the start of ``round_index``, with the weights of that moment: round
    ``round_index + lag``, and at round 0 every round up to it as well."""
    _check(round_index, lag)
    first = 0 if round_index == 0 else round_index + lag
    return list(range(first, round_index + lag + 1))


def _check(round_index: int, lag: int) -> None:
    if round_index < 0 or lag < 0:
        raise ValueError(f"round and lag must be >= 0, got round {round_index}, lag {lag}")

"""Which weights sample which round: pure functions of round indices.

Version v is the trainer's weights at the start of round v (after v rounds of K optimizer steps). With a fixed
lag k, round r is sampled with version max(r - k, 0): at the start of round r the trainer's weights (version r)
go to the engine for round r + k, and round r trains on what version r - k sampled. Rounds 0 .. k are all sampled
with the initial weights (there are no older ones), at the start of round 0.
"""

from __future__ import annotations


def sampling_version(round_index: int, lag: int) -> int:
    """The policy version that samples ``round_index`` under a fixed ``lag`` (0: on-policy)."""
    _check(round_index, lag)
    return max(round_index - lag, 0)


def rounds_to_submit(round_index: int, lag: int) -> list[int]:
    """The rounds whose sampling starts at the start of ``round_index``, with the weights of that moment: round
    ``round_index + lag``, and at round 0 every round up to it as well."""
    _check(round_index, lag)
    first = 0 if round_index == 0 else round_index + lag
    return list(range(first, round_index + lag + 1))


def policy_lag(trained_version: int, sampled_version: int) -> int:
    """How many versions old a sample is when it is trained on (>= 0)."""
    if sampled_version > trained_version:
        raise ValueError(f"a sample of version {sampled_version} cannot be trained at version {trained_version}")
    return trained_version - sampled_version


def _check(round_index: int, lag: int) -> None:
    if round_index < 0 or lag < 0:
        raise ValueError(f"round and lag must be >= 0, got round {round_index}, lag {lag}")

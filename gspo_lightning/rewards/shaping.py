"""Shaping rewards: a format check and a soft length penalty."""

from __future__ import annotations

import re
from typing import Any, Literal


class FormatReward:
    """1.0 when the stripped completion matches ``pattern`` in full (``re.fullmatch``), else 0.0.

    Args:
        pattern: a regular expression; add ``(?s)`` to let ``.`` match newlines.
    """

    def __init__(self, pattern: str) -> None:
        if not isinstance(pattern, str):
            raise TypeError(f"pattern must be a str, got {type(pattern).__name__}")
        try:
            self._regex = re.compile(pattern)
        except re.error as error:
            raise ValueError(f"pattern {pattern!r} is not a valid regular expression: {error}") from error
        self.pattern = pattern

    def __call__(self, prompts: list[Any], completions: list[str], **columns: list[Any]) -> list[float]:
        return [float(isinstance(c, str) and self._regex.fullmatch(c.strip()) is not None) for c in completions]


class LengthPenalty:
    """A penalty on long completions, measured in the policy's tokens (DAPO's overlong reward shaping, section 3.4).

    With ``n`` the completion's length: 0.0 for ``n <= max_tokens_soft``, then linearly down to -1.0 at
    ``n = max_tokens_hard`` (``-(n - soft) / (hard - soft)``), and -1.0 beyond; a non-string completion gets -1.0.
    ``GroupSampler`` hands it the policy's tokenizer at fit start (``setup``), so ``n`` counts the tokens the policy
    generated (the completion's text re-encoded without special tokens).

    Args:
        max_tokens_soft: length up to which there is no penalty; >= 0.
        max_tokens_hard: length at which the penalty reaches -1; > ``max_tokens_soft``.
        unit: ``tokens`` (the default) or ``characters`` (no tokenizer needed).
    """

    def __init__(self, max_tokens_soft: int, max_tokens_hard: int, unit: Literal["tokens", "characters"] = "tokens") -> None:
        for name, value in (("max_tokens_soft", max_tokens_soft), ("max_tokens_hard", max_tokens_hard)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"LengthPenalty.{name} must be an int, got {value!r}")
        if max_tokens_soft < 0:
            raise ValueError(f"LengthPenalty.max_tokens_soft must be >= 0, got {max_tokens_soft}")
        if max_tokens_hard <= max_tokens_soft:
            raise ValueError(
                f"LengthPenalty.max_tokens_hard ({max_tokens_hard}) must be greater than max_tokens_soft "
                f"({max_tokens_soft})"
            )
        if unit not in ("tokens", "characters"):
            raise ValueError(f"LengthPenalty.unit must be one of ['tokens', 'characters'], got {unit!r}")
        self.max_tokens_soft = max_tokens_soft
        self.max_tokens_hard = max_tokens_hard
        self.unit = unit
        self.tokenizer: Any = None

    def setup(self, tokenizer: Any) -> None:
        """Count lengths with ``tokenizer`` (the policy's; ``GroupSampler`` calls this at fit start)."""
        self.tokenizer = tokenizer

    def penalty(self, length: int) -> float:
        """The penalty for a completion of ``length`` units."""
        if length <= self.max_tokens_soft:
            return 0.0
        if length >= self.max_tokens_hard:
            return -1.0
        return -(length - self.max_tokens_soft) / (self.max_tokens_hard - self.max_tokens_soft)

    def length(self, completion: str) -> int:
        if self.unit == "characters":
            return len(completion)
        if self.tokenizer is None:
            raise RuntimeError(
                "LengthPenalty counts the policy's tokens but has no tokenizer: GroupSampler hands it over at fit "
                "start (LengthPenalty.setup(tokenizer)); outside it call setup yourself, or set unit: characters"
            )
        return len(self.tokenizer(completion, add_special_tokens=False)["input_ids"])

    def __call__(self, prompts: list[Any], completions: list[str], **columns: list[Any]) -> list[float]:
        return [self.penalty(self.length(c)) if isinstance(c, str) else -1.0 for c in completions]

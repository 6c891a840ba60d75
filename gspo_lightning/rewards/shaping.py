"""Shaping rewards: a format check and a soft length penalty."""

from __future__ import annotations

import re
from typing import Any


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
    """A penalty on long completions, measured in characters (no tokenizer needed).

    With ``n = len(completion)``: 0.0 for ``n <= max_tokens_soft``, then linearly down to -1.0 at
    ``n = max_tokens_hard`` (``-(n - soft) / (hard - soft)``), and -1.0 beyond; a non-string completion gets -1.0.

    Args:
        max_tokens_soft: length (characters) up to which there is no penalty; >= 0.
        max_tokens_hard: length (characters) at which the penalty reaches -1; > ``max_tokens_soft``.
        tokenizer_free: must be True: lengths are counted in characters (token counts are not supported).
    """

    def __init__(self, max_tokens_soft: int, max_tokens_hard: int, tokenizer_free: bool = True) -> None:
        for name, value in (("max_tokens_soft", max_tokens_soft), ("max_tokens_hard", max_tokens_hard)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if max_tokens_soft < 0:
            raise ValueError(f"max_tokens_soft must be >= 0, got {max_tokens_soft}")
        if max_tokens_hard <= max_tokens_soft:
            raise ValueError(
                f"max_tokens_hard ({max_tokens_hard}) must be greater than max_tokens_soft ({max_tokens_soft})"
            )
        if not tokenizer_free:
            raise ValueError("tokenizer_free=False is not supported: LengthPenalty counts characters")
        self.max_tokens_soft = max_tokens_soft
        self.max_tokens_hard = max_tokens_hard
        self.tokenizer_free = tokenizer_free

    def penalty(self, length: int) -> float:
        """The penalty for a completion of ``length`` characters."""
        if length <= self.max_tokens_soft:
            return 0.0
        if length >= self.max_tokens_hard:
            return -1.0
        return -(length - self.max_tokens_soft) / (self.max_tokens_hard - self.max_tokens_soft)

    def __call__(self, prompts: list[Any], completions: list[str], **columns: list[Any]) -> list[float]:
        return [self.penalty(len(c)) if isinstance(c, str) else -1.0 for c in completions]

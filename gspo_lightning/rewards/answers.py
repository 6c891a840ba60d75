"""Answer-checking rewards for tasks with one verifiable answer per prompt."""

from __future__ import annotations

from typing import Any


class ExactAnswer:
    """1.0 when the completion, stripped of surrounding white space, equals the reference answer, else 0.0.

    Args:
        answer_column: the data set column holding the reference answer.
    """

    def __init__(self, answer_column: str = "answer") -> None:
        self.answer_column = answer_column

    @property
    def required_columns(self) -> tuple[str, ...]:
        """The data set columns this reward reads (checked when the data is set up, before the model loads)."""
        return (self.answer_column,)

    def __call__(self, prompts: list[Any], completions: list[str], **columns: list[Any]) -> list[float]:
        if self.answer_column not in columns:
            raise KeyError(
                f"ExactAnswer needs the column {self.answer_column!r}; the data set has {sorted(columns)}"
            )
        answers = columns[self.answer_column]
        return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answers, strict=True)]

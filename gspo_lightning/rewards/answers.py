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


class FinalAnswer(ExactAnswer):
    """1.0 when the text after the completion's last ``marker`` equals the reference answer, else 0.0.

    For tasks whose response works towards an answer (``ScratchpadAdditionTask``'s ``...;+,0,878=878``): only
    the final answer is checked, not the working. A completion without the marker scores 0.0.

    Args:
        answer_column: the data set column holding the reference answer.
        marker: what precedes the final answer.
    """

    def __init__(self, answer_column: str = "answer", marker: str = "=") -> None:
        if not marker:
            raise ValueError("FinalAnswer's marker must be a non-empty string, got ''")
        super().__init__(answer_column)
        self.marker = marker

    def final_answer(self, completion: str) -> str | None:
        """The text after the last marker, stripped; None where there is no marker."""
        _, found, answer = completion.rpartition(self.marker)
        return answer.strip() if found else None

    def __call__(self, prompts: list[Any], completions: list[str], **columns: list[Any]) -> list[float]:
        finals = [self.final_answer(c) for c in completions]
        scores = super().__call__(prompts, [final or "" for final in finals], **columns)
        return [0.0 if final is None else score for score, final in zip(scores, finals, strict=True)]

"""Math word-problem reward: is the completion's final answer mathematically equal to the reference answer?

Parsing and comparison are done by the ``math-verify`` library, which understands LaTeX (``\\frac``,
``\\sqrt``, ``\\dfrac12``, percentages, intervals, ...) and plain numbers (``1,234``, ``0.5``, ``1/2``) and
compares them symbolically, so equivalent forms score the same.

Timeouts. ``math-verify`` bounds each parse and comparison with ``signal.alarm``, which only works in a
process's main thread, and the sampler calls rewards from a worker thread by default
(``sampler.reward_isolation: thread``). ``MathAnswer`` therefore applies its per-completion ``timeout_s`` only
when it runs in a main thread (``reward_isolation: none`` or ``process``); elsewhere math-verify runs without an
alarm and the sampler's ``reward_timeout_s`` bounds the whole call instead.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from typing import Any, Literal

GoldFormat = Literal["auto", "gsm8k", "boxed", "plain"]
GOLD_FORMATS: tuple[str, ...] = ("auto", "gsm8k", "boxed", "plain")

_BOX_COMMANDS = ("\\boxed", "\\fbox")
# A GSM8K final answer: an optionally signed number, thousands separated by commas, maybe a "$" in front.
_GSM8K_NUMBER = re.compile(r"\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?|-?\.[0-9]+)")
_SHOWN_CHARACTERS = 200


class _TimeoutNoticeFilter(logging.Filter):
    """Drops math-verify's "Timeout is disabled ... provide the logic yourself" warning: here the sampler's
    ``reward_timeout_s`` is that logic, so the warning would only mislead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_TimeoutNoticeFilter())


class GoldAnswerError(ValueError):
    """A reference answer could not be parsed: a bug in the data, not in the completion."""


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``) in ``text``; None if none.

    Braces are matched, so ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``; an unclosed box gives None.
    """
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    command = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    rest = text[start + len(command) :]
    if rest.startswith(" "):  # "\boxed 5": the argument is the next token
        token = rest.strip().split()
        return token[0].rstrip("$.") if token else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for index, char in enumerate(rest):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return rest[1:index]
    return None


def detect_gold_format(gold: str) -> str:
    """The ``gold_format`` that ``"auto"`` picks for one reference: gsm8k, boxed or plain."""
    if "####" in gold:
        return "gsm8k"
    if any(command in gold for command in _BOX_COMMANDS):
        return "boxed"
    return "plain"


@functools.lru_cache(maxsize=4096)  # each reference is scored once per response in its group
def parse_gold(gold: str, gold_format: str, timeout_s: int | None = None) -> tuple[Any, ...]:
    """The parsed reference answer (math-verify's list, as a tuple); raises ``GoldAnswerError`` if unparsable.

    Args:
        gold: the reference text of one row.
        gold_format: ``auto``, ``gsm8k``, ``boxed`` or ``plain`` (see :class:`MathAnswer`).
        timeout_s: math-verify's parsing timeout; None (no alarm) unless called in a main thread.
    """
    from math_verify import parse  # imported on first use: it loads sympy (~0.4 s) for every other task

    fmt = detect_gold_format(gold) if gold_format == "auto" else gold_format
    if fmt == "gsm8k":
        if "####" not in gold:
            raise GoldAnswerError("gold_format 'gsm8k' expects the reference to end with '#### <number>'")
        match = _GSM8K_NUMBER.fullmatch(gold.rsplit("####", 1)[1].strip())
        if match is None:
            raise GoldAnswerError("the text after '####' is not a number")
        answer: str | None = match.group(1).replace(",", "")
    elif fmt == "boxed":
        answer = last_boxed(gold)
        if answer is None:
            raise GoldAnswerError("gold_format 'boxed' expects a complete \\boxed{...} in the reference")
    else:
        answer = gold.strip()
    # Re-boxed, so that math-verify reads the whole answer as one LaTeX expression.
    parsed = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout_s) if answer else []
    if not parsed:
        raise GoldAnswerError(f"math-verify found no answer in {answer!r} (read as {fmt})")
    return tuple(parsed)


class MathAnswer:
    """1.0 when the completion's final answer equals the reference answer (checked by math-verify), else 0.0.

    The completion's answer is its last ``\\boxed{...}`` when it has one; otherwise (unless ``require_boxed``)
    whatever math-verify extracts from the whole text (LaTeX or a plain number, e.g. "The answer is 1,234.").
    A completion with no answer math-verify can read scores 0.0; a reference it cannot read raises
    ``GoldAnswerError`` naming the row, since that is a bug in the data.

    Args:
        answer_column: the data set column holding the reference (``answer`` in openai/gsm8k, ``solution`` in
            competition MATH).
        gold_format: how to read the reference: ``gsm8k`` (reasoning ending in ``#### <number>``, as in
            openai/gsm8k), ``boxed`` (a worked solution whose last ``\\boxed{...}`` is the answer, as in
            competition MATH), ``plain`` (the column is the bare answer, e.g. ``\\frac{1}{2}`` or ``42``), or
            ``auto`` (per row: gsm8k if it contains ``####``, else boxed if it contains ``\\boxed``, else plain).
        require_boxed: score 0.0 for completions without a ``\\boxed{...}`` answer instead of searching the
            whole text for one (stricter: the model must state its answer in the asked-for form).
        float_rounding: decimal places numbers are rounded to before they are compared (math-verify's
            ``float_rounding``): with 2, ``0.333`` matches ``1/3``; with the default 6 it does not.
        timeout_s: seconds math-verify may spend parsing or comparing one completion, or None for no limit.
            Enforced with ``signal.alarm``, so only where the reward runs in a main thread (sampler
            ``reward_isolation`` ``process`` or ``none``); in a worker thread (the default ``thread``) the
            sampler's ``reward_timeout_s`` bounds the whole call instead.
    """

    def __init__(
        self,
        answer_column: str = "answer",
        gold_format: GoldFormat = "auto",
        require_boxed: bool = False,
        float_rounding: int = 6,
        timeout_s: int | None = 5,
    ) -> None:
        if not isinstance(answer_column, str) or not answer_column:
            raise ValueError(f"answer_column must be a non-empty column name, got {answer_column!r}")
        if gold_format not in GOLD_FORMATS:
            raise ValueError(f"gold_format must be one of {list(GOLD_FORMATS)}, got {gold_format!r}")
        if not isinstance(require_boxed, bool):
            raise ValueError(f"require_boxed must be true or false, got {require_boxed!r}")
        if isinstance(float_rounding, bool) or not isinstance(float_rounding, int) or not 0 <= float_rounding <= 15:
            raise ValueError(f"float_rounding must be an integer from 0 to 15 (decimal places), got {float_rounding!r}")
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, int) or timeout_s < 1):
            # signal.alarm counts whole seconds
            raise ValueError(f"timeout_s must be a whole number of seconds >= 1, or None, got {timeout_s!r}")
        self.answer_column = answer_column
        self.gold_format = gold_format
        self.require_boxed = require_boxed
        self.float_rounding = float_rounding
        self.timeout_s = timeout_s

    @property
    def required_columns(self) -> tuple[str, ...]:
        """The data set columns this reward reads (checked when the data is set up, before the model loads)."""
        return (self.answer_column,)

    def __call__(self, prompts: list[Any], completions: list[str], **columns: list[Any]) -> list[float]:
        """One score per completion, against the reference in ``columns[answer_column]`` of its row."""
        if self.answer_column not in columns:
            raise KeyError(f"MathAnswer needs the column {self.answer_column!r}; the data set has {sorted(columns)}")
        timeout = self.timeout_s if threading.current_thread() is threading.main_thread() else None
        scores = []
        for row, (completion, gold) in enumerate(zip(completions, columns[self.answer_column], strict=True)):
            try:
                # a missing reference (None) reads as empty, which parse_gold rejects, not as the text 'None'
                parsed_gold = parse_gold("" if gold is None else str(gold), self.gold_format, timeout)
            except GoldAnswerError as error:
                raise self._gold_error(row, gold, prompts[row], error) from None
            scores.append(self.score(completion, parsed_gold, timeout))
        return scores

    def _gold_error(self, row: int, gold: Any, prompt: Any, error: GoldAnswerError) -> GoldAnswerError:
        """An error naming the row, its reference and its prompt: enough to find it in the data set."""
        limit = _SHOWN_CHARACTERS
        if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
            prompt = prompt[-1].get("content", prompt)  # a chat prompt: the user's question, not the system prompt
        return GoldAnswerError(
            f"MathAnswer: row {row} of the batch has a reference answer in column {self.answer_column!r} that "
            f"cannot be parsed with gold_format={self.gold_format!r}: {error}. Reference (last {limit} "
            f"characters): {str(gold)[-limit:]!r}; prompt (first {limit}): {str(prompt)[:limit]!r}"
        )

    def score(self, completion: Any, parsed_gold: tuple[Any, ...], timeout: int | None = None) -> float:
        """The reward of one completion against an already parsed reference (see :func:`parse_gold`)."""
        from math_verify import parse, verify  # on first use, as in parse_gold

        if not isinstance(completion, str):
            return 0.0
        boxed = last_boxed(completion)
        if boxed is None and self.require_boxed:
            return 0.0
        text = completion if boxed is None else f"\\boxed{{{boxed}}}"
        answer = parse(text, parsing_timeout=timeout)
        if not answer:
            return 0.0
        correct = verify(list(parsed_gold), answer, float_rounding=self.float_rounding, timeout_seconds=timeout)
        return float(correct)

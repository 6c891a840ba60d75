"""Countdown reward: does the completion's expression reach the target from the given numbers?

The expression is parsed with :mod:`ast` and evaluated by walking the tree; nothing in a completion is ever
evaluated, executed or compiled as code. Only integer literals, ``+ - * /``, unary minus and parentheses are
accepted; arithmetic is exact (:class:`fractions.Fraction`).
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from fractions import Fraction
from typing import Any

MAX_EXPRESSION_CHARS = 200
MAX_CONSTANT = 10**6
_ALLOWED_CHARS = re.compile(r"[0-9+\-*/() \t]+")
_BINARY_OPERATORS = (ast.Add, ast.Sub, ast.Mult, ast.Div)


class _Rejected(Exception):
    """The expression is not an allowed Countdown expression."""


def extract_expression(completion: str) -> str:
    """The text after the last ``Answer:`` if present, else the last non-empty line; a trailing ``= ...`` is
    dropped (``(50-25)*3 = 75`` gives ``(50-25)*3``)."""
    if "Answer:" in completion:
        text = completion.rsplit("Answer:", 1)[1].strip()
        text = text.splitlines()[0] if text else ""
    else:
        lines = [line for line in completion.splitlines() if line.strip()]
        text = lines[-1] if lines else ""
    return text.split("=", 1)[0].strip()


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    """Exact value of an allowed expression tree; appends every literal to ``used``."""
    if isinstance(node, ast.Constant):
        if type(node.value) is not int or not 0 <= node.value <= MAX_CONSTANT:
            raise _Rejected
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand, used)
    if isinstance(node, ast.BinOp) and isinstance(node.op, _BINARY_OPERATORS):
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if right == 0:
            raise _Rejected  # division by zero
        return left / right
    raise _Rejected  # names, calls, attributes, powers, comparisons, ...


def evaluate_expression(expression: str) -> tuple[Fraction, list[int]] | None:
    """``(value, literals used)`` of an allowed expression, or None when it is not one (or divides by 0)."""
    if not isinstance(expression, str) or not expression.strip() or len(expression) > MAX_EXPRESSION_CHARS:
        return None
    if not _ALLOWED_CHARS.fullmatch(expression):
        return None  # letters, dots, quotes, underscores, ...: nothing to parse
    try:
        tree = ast.parse(expression.strip(), mode="eval")  # parses only; nothing is compiled or run
        used: list[int] = []
        value = _evaluate(tree.body, used)
    except (_Rejected, SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    return value, used


def _parse_numbers(numbers: Any) -> Counter[int]:
    if isinstance(numbers, str):
        return Counter(int(n) for n in numbers.replace(",", " ").split())
    return Counter(int(n) for n in numbers)


class CountdownAnswer:
    """1.0 when the completion's expression uses only the given numbers (each at most as often as given) and
    equals the target, else 0.0; malformed or disallowed expressions score 0.0 and never raise.

    The expression is the text after the last ``Answer:`` if present, else the completion's last non-empty
    line (see :func:`extract_expression`).

    Args:
        numbers_column: the data set column holding the given numbers (``"3 7 25 50"`` or a list of ints).
        target_column: the data set column holding the target.
    """

    def __init__(self, numbers_column: str = "numbers", target_column: str = "target") -> None:
        self.numbers_column = numbers_column
        self.target_column = target_column

    @property
    def required_columns(self) -> tuple[str, ...]:
        """The data set columns this reward reads (checked when the data is set up, before the model loads)."""
        return (self.numbers_column, self.target_column)

    def __call__(self, prompts: list[Any], completions: list[str], **columns: list[Any]) -> list[float]:
        for column in (self.numbers_column, self.target_column):
            if column not in columns:
                raise KeyError(f"CountdownAnswer needs the column {column!r}; the data set has {sorted(columns)}")
        return [
            self.score(completion, numbers, target)
            for completion, numbers, target in zip(
                completions, columns[self.numbers_column], columns[self.target_column], strict=True
            )
        ]

    @staticmethod
    def score(completion: str, numbers: Any, target: Any) -> float:
        """The reward of one completion."""
        if not isinstance(completion, str):
            return 0.0
        result = evaluate_expression(extract_expression(completion))
        if result is None:
            return 0.0
        value, used = result
        try:
            given, wanted = _parse_numbers(numbers), Fraction(str(target).strip())
        except (TypeError, ValueError, ZeroDivisionError):
            return 0.0
        if Counter(used) - given:  # a number not given, or used more often than given
            return 0.0
        return float(value == wanted)

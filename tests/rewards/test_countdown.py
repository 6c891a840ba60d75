"""CountdownAnswer: exact, safe scoring of Countdown expressions."""

from __future__ import annotations

import os
import time

import pytest

from gspo_lightning.rewards.countdown import CountdownAnswer, evaluate_expression, extract_expression

NUMBERS = "3 7 25 50"


def score(completion: str, numbers: str = NUMBERS, target: str = "75") -> float:
    return CountdownAnswer()(["p"], [completion], numbers=[numbers], target=[target])[0]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("(50 - 25) * 3", 1.0),
        ("Let me think.\n50 + 25", 1.0),
        ("I try 50+25.\nAnswer: 50 + 25\n", 1.0),
        ("(50-25)*3 = 75", 1.0),
        ("50 + 25 + 3", 0.0),  # wrong value
        ("50 + 20 + 5", 0.0),  # numbers not given
        ("25 + 25 + 25", 0.0),  # 25 reused
        ("50 + 7 * 3 + 3 + 1", 0.0),
        ("-(3 - 7) * 25 - 25", 0.0),  # 25 reused
        ("", 0.0),
        ("no numbers here", 0.0),
        ("(50 - 25 * 3", 0.0),  # syntax error
        ("Answer:", 0.0),
    ],
)
def test_correct_incorrect_malformed(completion: str, expected: float) -> None:
    assert score(completion) == expected


def test_unary_minus_and_list_numbers() -> None:
    assert score("-(3 - 7) * 25 - 25", numbers="3 7 25 25") == 1.0
    assert CountdownAnswer("nums", "goal")(["p"], ["7*3"], nums=[[3, 7]], goal=[21]) == [1.0]


def test_division_is_exact() -> None:
    assert score("7 / 2 * 50", numbers="2 7 50", target="175") == 1.0  # 3.5 * 50, no integer division
    assert score("7 / 3 * 3", numbers="3 3 7", target="7") == 1.0  # no floating-point error
    assert score("50 / 7", target="7") == 0.0  # 7.14..., not floored
    assert score("50 / (7 - 7)", numbers="7 7 50", target="0") == 0.0  # division by zero


@pytest.mark.parametrize(
    "completion",
    [
        "__import__('os').system('x')",
        "2**100000",
        "9**9**9**9",
        "(1).__class__",
        "().__class__.__bases__[0].__subclasses__()",
        "abs(-75)",
        "x + 75",
        "75.0",
        "True * 75",
        "lambda: 75",
        "[75][0]",
        "1000001 - 999926",  # constant above 10**6
        "(" * 100 + "75" + ")" * 100,  # longer than 200 characters
        "1+" * 5000 + "1",
        "(" * 100000,
        "Answer: " + "-" * 100000 + "75",
    ],
)
def test_hostile_expressions_score_zero_without_evaluation(completion: str, monkeypatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(os, "system", lambda command: calls.append(command))
    start = time.perf_counter()
    assert score(completion, numbers="1 75 999926 1000001") == 0.0
    assert time.perf_counter() - start < 1.0
    assert calls == []


def test_non_string_and_bad_columns_score_zero() -> None:
    reward = CountdownAnswer()
    assert reward(["p", "p"], [None, 75], numbers=[NUMBERS, NUMBERS], target=["75", "75"]) == [0.0, 0.0]
    assert reward(["p"], ["50+25"], numbers=["a b"], target=["75"]) == [0.0]


def test_missing_column_is_a_clear_error() -> None:
    with pytest.raises(KeyError, match="'target'"):
        CountdownAnswer()(["p"], ["1"], numbers=[NUMBERS])


def test_helpers() -> None:
    assert extract_expression("work\n\n 3 + 4 \n\n") == "3 + 4"
    assert extract_expression("Answer: 3+4\nmore text") == "3+4"
    assert evaluate_expression("(1 + 2) * -3") is not None
    value, used = evaluate_expression("(1 + 2) * -3")
    assert (value, used) == (-9, [1, 2, 3])
    assert evaluate_expression("2 ** 3") is None

"""Scratchpad addition: the written-out working, its length, and the task's split."""

from __future__ import annotations

import random

import pytest

from gspo_lightning.data.arithmetic import is_heldout
from gspo_lightning.data.scratchpad import (
    ScratchpadAdditionTask,
    addition_scratchpad,
    scratchpad_length,
    scratchpad_problems,
)


def test_the_scratchpad_of_a_hand_worked_sum():
    # 482 + 396: 2+6 = 8 carry 0; 8+9 = 17 -> 7 carry 1; 4+3+1 = 8 carry 0
    assert addition_scratchpad("482", "396") == "48+39,0,8;4+3,1,78;+,0,878=878"
    # a final carry becomes the answer's first digit
    assert addition_scratchpad("999", "999") == "99+99,1,8;9+9,1,98;+,1,998=1998"


def test_every_line_holds_what_is_left_the_carry_and_the_result_so_far():
    rng = random.Random(0)
    for _ in range(200):
        digits = rng.randint(3, 12)
        a, b = (str(rng.randint(10 ** (digits - 1), 10**digits - 1)) for _ in range(2))
        working, answer = addition_scratchpad(a, b).rsplit("=", 1)
        assert int(answer) == int(a) + int(b)
        for i, line in enumerate(working.split(";"), start=1):
            rest, carry, result = line.split(",")
            assert rest == f"{a[:-i]}+{b[:-i]}"
            low = int(a[-i:]) + int(b[-i:])  # the last i digits of each operand, summed
            assert (int(carry), result) == (low // 10**i, str(low % 10**i).zfill(i))


def test_scratchpad_length_bounds_every_response_and_is_reached():
    for digits in (3, 5, 8):
        lengths = {len(p["scratchpad"]) for p in scratchpad_problems(300, digits)}
        assert max(lengths) <= scratchpad_length(digits)
    assert scratchpad_length(5) == 66 and scratchpad_length(8) == 141


@pytest.mark.parametrize("a, b", [("12", "345"), ("1a", "23"), ("", "")])
def test_bad_operands_are_refused(a, b):
    with pytest.raises(ValueError, match="digit strings of equal length"):
        addition_scratchpad(a, b)


def test_the_task_keeps_the_held_out_side_apart_and_carries_the_answer():
    splits = ScratchpadAdditionTask(num_digits=5, train_size=64, eval_size=16).load()
    assert not any(map(is_heldout, splits["train"]["question"]))
    assert all(map(is_heldout, splits["eval"]["question"]))
    for row in splits["train"]:
        a, b = row["question"].split("+")
        assert row["answer"] == str(int(a) + int(b)) and row["scratchpad"].endswith("=" + row["answer"])


def test_responses_of_a_few_tokens_are_refused():
    with pytest.raises(ValueError, match="num_digits must be >= 3"):
        ScratchpadAdditionTask(num_digits=2)

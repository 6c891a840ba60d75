"""FormatReward and LengthPenalty, hand-computed."""

from __future__ import annotations

import pytest

from gspo_lightning.rewards.shaping import FormatReward, LengthPenalty


def test_format_reward() -> None:
    reward = FormatReward(r"Answer: \d+")
    completions = ["Answer: 42", "  Answer: 42\n", "Answer: 42 extra", "answer: 42", "", None]
    assert reward(["p"] * 6, completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert FormatReward(r"(?s)<think>.*</think>\s*\d+")(["p"], ["<think>a\nb</think>\n7"]) == [1.0]


def test_format_reward_bad_pattern() -> None:
    with pytest.raises(ValueError, match="not a valid regular expression"):
        FormatReward("(")
    with pytest.raises(TypeError, match="must be a str"):
        FormatReward(3)


def test_length_penalty() -> None:
    penalty = LengthPenalty(max_tokens_soft=10, max_tokens_hard=20)
    completions = ["", "x" * 10, "x" * 11, "x" * 15, "x" * 19, "x" * 20, "x" * 500, None]
    assert penalty(["p"] * 8, completions) == pytest.approx([0.0, 0.0, -0.1, -0.5, -0.9, -1.0, -1.0, -1.0])
    assert LengthPenalty(0, 4)(["p"], ["ab"]) == [-0.5]


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((-1, 10), ValueError, "max_tokens_soft must be >= 0"),
        ((10, 10), ValueError, "must be greater than max_tokens_soft"),
        ((10, 5), ValueError, "must be greater than max_tokens_soft"),
        ((1.5, 10), TypeError, "max_tokens_soft must be an int"),
        ((1, True), TypeError, "max_tokens_hard must be an int"),
    ],
)
def test_length_penalty_validation(args, error, message) -> None:
    with pytest.raises(error, match=message):
        LengthPenalty(*args)
    with pytest.raises(ValueError, match="tokenizer_free=False"):
        LengthPenalty(1, 2, tokenizer_free=False)

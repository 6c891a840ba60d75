"""Answer rewards: the whole completion (ExactAnswer) or the text after the last marker (FinalAnswer)."""

from __future__ import annotations

import pytest

from gspo_lightning.rewards import ExactAnswer, FinalAnswer


def test_final_answer_scores_only_the_text_after_the_last_marker():
    completions = ["48+39,0,8;4+3,1,78;+,0,878=878", "4+3,1,78=878 ", "878", "1=2=878", "=877", ""]
    scores = FinalAnswer()(["482+396="] * 6, completions, answer=["878"] * 6)
    assert scores == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]  # no marker, no answer: the bare "878" does not count


def test_final_answer_with_another_marker_and_column():
    reward = FinalAnswer(answer_column="target", marker="####")
    assert reward.required_columns == ("target",)
    assert reward(["q", "q"], ["work #### 42", "#### 4 2"], target=["42", "42"]) == [1.0, 0.0]
    assert reward.final_answer("no marker") is None


def test_final_answer_refuses_an_empty_marker_and_a_missing_column():
    with pytest.raises(ValueError, match="marker must be a non-empty string"):
        FinalAnswer(marker="")
    with pytest.raises(KeyError, match="needs the column 'answer'"):
        FinalAnswer()(["q"], ["=1"], target=["1"])


def test_exact_answer_compares_the_whole_completion():
    assert ExactAnswer()(["q", "q"], [" 878 ", "=878"], answer=["878", "878"]) == [1.0, 0.0]

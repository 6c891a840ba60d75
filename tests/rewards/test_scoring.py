import math
import time

import pytest
import torch

from gspo_lightning.rewards import ExactAnswer, score_completions
from gspo_lightning.rewards.isolation import RewardRunner
from tests.rewards.reward_helpers import hanging_reward


def _length(prompts, completions, **columns):
    return [float(len(c)) for c in completions]


def test_weighted_sum_and_components():
    total, components = score_completions(
        [ExactAnswer(), _length], [2.0, 0.5], ["1+1=", "1+1="], ["2", " 3 "], {"answer": ["2", "2"]}
    )
    torch.testing.assert_close(total, torch.tensor([2.0 * 1 + 0.5 * 1, 0.5 * 3]))
    assert set(components) == {"ExactAnswer", "_length"}


@pytest.mark.parametrize(
    ("fn", "error", "message"),
    [
        (lambda p, c, **k: [1.0], ValueError, "returned 1 values for 2 completions"),
        (lambda p, c, **k: [1.0, math.nan], ValueError, "returned nan"),
        (lambda p, c, **k: [1.0, "x"], TypeError, "non-number 'x'"),
        (lambda p, c, **k: 1.0, TypeError, "must return a list of floats"),
        (lambda p, c, **k: 1 / 0, RuntimeError, "raised ZeroDivisionError"),
    ],
)
def test_misbehaving_reward_functions_get_named_errors(fn, error, message):
    with pytest.raises(error, match=message):
        score_completions([fn], [1.0], ["a", "b"], ["x", "y"], {})


def test_exact_answer_missing_column_lists_columns():
    with pytest.raises(RuntimeError, match="needs the column 'answer'"):
        score_completions([ExactAnswer()], [1.0], ["a"], ["1"], {"solution": ["1"]})


def _boom(prompts, completions, **columns):
    return [1 / 0 for _ in completions]


def _nan_for_second(prompts, completions, **columns):
    return [math.nan if i == 1 else 1.0 for i in range(len(completions))]


def _short(prompts, completions, **columns):
    return [1.0]


def _word_for_second(prompts, completions, **columns):
    return ["good" if i == 1 else 1.0 for i in range(len(completions))]


PROMPTS, COMPLETIONS = ["a", "b", "c"], ["x", "y", "z"]


def test_raise_mode_names_the_function_and_the_first_sample():
    raised = r"reward function _boom raised ZeroDivisionError.*sample 0: completion 'x', prompt 'a'"
    with pytest.raises(RuntimeError, match=raised):
        score_completions([_boom], [1.0], PROMPTS, COMPLETIONS, {})
    nan = r"_nan_for_second returned nan \(first offending sample 1: completion 'y', prompt 'b'\)"
    with pytest.raises(ValueError, match=nan):
        score_completions([_nan_for_second], [1.0], PROMPTS, COMPLETIONS, {})
    with pytest.raises(TypeError, match=r"_word_for_second returned a non-number 'good' \(first offending sample 1"):
        score_completions([_word_for_second], [1.0], PROMPTS, COMPLETIONS, {})


def test_raise_mode_times_out_a_hanging_function_quickly():
    started = time.perf_counter()
    timed_out = r"reward function hanging_reward did not return within reward_timeout_s=0.5 s.*prompt 'a'"
    with pytest.raises(TimeoutError, match=timed_out):
        score_completions([hanging_reward], [1.0], PROMPTS, COMPLETIONS, {}, runner=RewardRunner("thread", 0.5))
    assert time.perf_counter() - started < 2.0


@pytest.mark.parametrize(
    ("fn", "affected"),
    [
        (_nan_for_second, [1]),  # a bad value affects its own sample
        (_word_for_second, [1]),
        (_short, [0, 1, 2]),  # a failed call affects the whole batch
        (_boom, [0, 1, 2]),
        (lambda p, c, **k: 1.0, [0, 1, 2]),
    ],
)
def test_skip_mode_marks_the_affected_samples_nan(fn, affected, caplog):
    total, components = score_completions(
        [fn, _length], [1.0, 1.0], PROMPTS, COMPLETIONS, {}, errors="skip"
    )
    assert total.isnan().nonzero().flatten().tolist() == affected
    assert components["_length"].tolist() == [1.0, 1.0, 1.0]  # the other function is unaffected
    assert f"{len(affected)} sample(s) left out" in caplog.text


def test_skip_mode_survives_a_timeout():
    total, _ = score_completions(
        [hanging_reward], [1.0], PROMPTS, COMPLETIONS, {}, runner=RewardRunner("thread", 0.5), errors="skip"
    )
    assert total.isnan().all()


def test_unpicklable_reward_raises_even_in_skip_mode():
    with pytest.raises(TypeError, match="reward function <lambda>: cannot send the reward function"):
        score_completions(
            [lambda p, c: [1.0] * 3], [1.0], PROMPTS, COMPLETIONS, {}, runner=RewardRunner("process"), errors="skip"
        )

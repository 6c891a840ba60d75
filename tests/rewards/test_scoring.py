import math

import pytest
import torch

from gspo_lightning.rewards import ExactAnswer, score_completions


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

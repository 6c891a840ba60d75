"""A reward's declared columns against the data's."""

from __future__ import annotations

import pytest

from gspo_lightning.rewards import ExactAnswer
from gspo_lightning.rewards.columns import check_reward_columns
from gspo_lightning.validation import DataError


def test_rewards_columns_are_checked_by_the_name_they_are_configured_with():
    check_reward_columns([ExactAnswer("solution")], ["question", "solution"], "d", "sampler.rewards")
    with pytest.raises(DataError, match=r"evaluation.correct: ExactAnswer reads the column\(s\) \['solution'\]"):
        check_reward_columns([ExactAnswer("solution")], ["question", "answer"], "d", "evaluation.correct")
    check_reward_columns([lambda prompts, completions, **columns: []], [], "d", "sampler.rewards")  # undeclared

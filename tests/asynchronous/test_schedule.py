"""Which weights sample which round: the fixed-lag schedule, as pure functions."""

from __future__ import annotations

import pytest

from gspo_lightning.asynchronous.schedule import rounds_to_submit


@pytest.mark.parametrize("lag", [1, 2, 4])
def test_every_round_is_submitted_once_with_the_weights_lag_rounds_before_it(lag):
    submitted = {}
    for round_index in range(20):
        for target in rounds_to_submit(round_index, lag):
            assert target not in submitted  # sampled once
            submitted[target] = round_index  # with the weights at the start of this round
        assert round_index in submitted  # round r's samples exist when it trains
    for target in range(20):
        assert submitted[target] == max(target - lag, 0)  # round r sampled by version r - lag (0 at the start)


def test_one_step_off_policy_by_hand():
    assert rounds_to_submit(0, 1) == [0, 1]  # round 0 and 1 from the initial weights
    assert rounds_to_submit(1, 1) == [2]  # round 2 from the weights at round 1's start
    assert rounds_to_submit(0, 2) == [0, 1, 2] and rounds_to_submit(3, 2) == [5]


def test_lag_zero_is_on_policy():
    assert [rounds_to_submit(r, 0) for r in range(3)] == [[0], [1], [2]]


def test_a_negative_round_or_lag_is_refused():
    with pytest.raises(ValueError, match=">= 0"):
        rounds_to_submit(-1, 1)

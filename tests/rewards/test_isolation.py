"""Reward isolation: a hanging, crashing or unpicklable reward function cannot take the trainer down."""

from __future__ import annotations

import os
import time

import pytest

from gspo_lightning.rewards import score_completions
from gspo_lightning.rewards.isolation import (
    RewardNotPicklableError,
    RewardRunner,
    RewardTimeoutError,
    RewardWorkerCrashedError,
)
from tests.rewards.reward_helpers import constant_reward, exiting_reward, hanging_reward, worker_pid_reward

PROMPTS, COMPLETIONS = ["1+1=", "2+2="], ["2", "4"]


def test_thread_mode_stops_waiting_at_the_timeout():
    runner = RewardRunner("thread", timeout_s=0.5)
    started = time.perf_counter()
    with pytest.raises(TimeoutError, match=r"did not return within reward_timeout_s=0.5 s"):
        runner(hanging_reward, PROMPTS, COMPLETIONS, {})
    assert time.perf_counter() - started < 2.0
    assert runner(constant_reward, PROMPTS, COMPLETIONS, {}) == [1.0, 1.0]  # the next call is unaffected


def test_thread_mode_passes_exceptions_and_columns_through():
    runner = RewardRunner("thread", timeout_s=5.0)
    assert runner(lambda p, c, answer: [float(a == x) for a, x in zip(answer, c)], PROMPTS, COMPLETIONS,
                  {"answer": ["2", "5"]}) == [1.0, 0.0]
    with pytest.raises(ZeroDivisionError):
        runner(lambda p, c: [1 / 0], PROMPTS, COMPLETIONS, {})


def test_process_mode_contains_a_dying_worker_and_recovers():
    runner = RewardRunner("process", timeout_s=20.0)
    try:
        with pytest.raises(RewardWorkerCrashedError, match="reward function exiting_reward killed its worker"):
            score_completions([exiting_reward], [1.0], PROMPTS, COMPLETIONS, {}, runner=runner)
        # The trainer's process survived, and a new worker serves the next call.
        pid = runner(worker_pid_reward, PROMPTS, COMPLETIONS, {})[0]
        assert pid != os.getpid()
    finally:
        runner.close()


def test_process_mode_kills_a_hanging_worker_at_the_timeout():
    runner = RewardRunner("process", timeout_s=0.5)
    try:
        runner(constant_reward, PROMPTS, COMPLETIONS, {})  # worker started and warm
        started = time.perf_counter()
        with pytest.raises(RewardTimeoutError, match="did not return within 0.5 s"):
            runner(hanging_reward, PROMPTS, COMPLETIONS, {})
        assert time.perf_counter() - started < 2.0
    finally:
        runner.close()


def test_process_mode_names_what_cannot_be_pickled():
    runner = RewardRunner("process", timeout_s=5.0)
    with pytest.raises(RewardNotPicklableError, match="reward function.*module level.*'thread'"):
        runner(lambda p, c: [1.0, 1.0], PROMPTS, COMPLETIONS, {})
    assert runner._pool is None  # nothing was started for it


@pytest.mark.parametrize(
    ("isolation", "timeout_s", "message"),
    [
        ("none", 5.0, "'none' cannot stop a call"),
        ("fork", None, "must be one of"),
        ("thread", 0.0, "must be > 0"),
    ],
)
def test_runner_settings_are_checked(isolation, timeout_s, message):
    with pytest.raises(ValueError, match=message):
        RewardRunner(isolation, timeout_s)


def test_no_isolation_calls_directly():
    assert RewardRunner("none", None)(constant_reward, PROMPTS, COMPLETIONS, {}) == [1.0, 1.0]

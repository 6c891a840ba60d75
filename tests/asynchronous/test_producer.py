"""Producers: a job's result depends on what it was given, not on where or when it ran."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gspo_lightning.asynchronous.producer import Producer
from gspo_lightning.rollout.types import Rollout


def _rollout(value: int) -> Rollout:
    ids = torch.full((2, 3), value)
    return Rollout(ids, torch.ones_like(ids), ids, torch.ones_like(ids), torch.zeros(2), None, torch.zeros(2, dtype=bool))


def _job(value: int, seen: list, delay: float = 0.0):
    def job():
        time.sleep(delay)
        seen.append((value, threading.current_thread().name))
        return _rollout(value), {"generate_s": delay}

    return job


def test_inline_runs_each_job_at_once_in_the_callers_thread():
    producer, seen = Producer(background=False), []
    producer.submit(0, 0, _job(0, seen))
    assert seen == [(0, threading.current_thread().name)] and 0 in producer and producer.depth == 1
    taken = producer.take(0)
    assert (taken.round_index, taken.version, int(taken.rollout.response_ids[0, 0])) == (0, 0, 0)
    assert producer.depth == 0
    with pytest.raises(RuntimeError, match="never submitted"):
        producer.take(1)


def test_background_runs_jobs_in_order_on_its_own_thread_while_the_caller_goes_on():
    producer, seen = Producer(background=True), []
    try:
        started = time.perf_counter()
        for index in range(3):
            producer.submit(index, 7, _job(index, seen, delay=0.2))
        assert time.perf_counter() - started < 0.1  # submitting does not wait
        assert producer.depth == 3 and 2 in producer
        assert producer.take(1).version == 7  # waits for job 1 (and so job 0, which ran first)
        assert [value for value, _ in seen[:2]] == [0, 1]
        assert all(name.startswith("gspo-rollout") for _, name in seen)
        finished = producer.finished()  # drains: job 2 completes
        assert [r.round_index for r in finished] == [0, 2] and finished[1].finished >= finished[1].started
    finally:
        producer.close()


def test_a_failing_job_raises_in_the_trainers_thread():
    producer = Producer(background=True)

    def broken():
        raise ValueError("reward exploded")

    try:
        producer.submit(0, 0, broken)
        with pytest.raises(ValueError, match="reward exploded"):
            producer.take(0)
    finally:
        producer.close()


def test_a_restored_round_is_taken_as_sampled_and_a_closed_producer_holds_nothing():
    producer, seen = Producer(background=True), []
    try:
        producer.submit(0, 0, _job(0, seen))
        producer.restore(producer.finished())  # what a checkpoint saved, put back
        assert 0 in producer and producer.take(0).round_index == 0
        producer.submit(1, 0, _job(1, seen, delay=0.2))
    finally:
        producer.close()
    assert producer.depth == 0

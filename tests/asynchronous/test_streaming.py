"""The streaming producer with a scripted engine: admission control keeps every token within the bound, samples
in flight continue under new weights with each token's version recorded, and its state survives a restart."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from gspo_lightning.asynchronous.rounds import partial_fraction
from gspo_lightning.asynchronous.streaming import StreamingProducer, admissible, groups_rollout
from gspo_lightning.engines.base import EngineSamples, SamplingEngine, SamplingSettings
from gspo_lightning.models import TinyQwen3
from gspo_lightning.rollout.pipeline import Scoring
from tests.conftest import TINY

G, P, BOUND, LENGTH = 2, 2, 1, 6


class ChunkEngine(SamplingEngine):
    """Writes token 5 (never EOS) for every row of a chunk; records the loaded version of every chunk."""

    runs_in_background = True

    def __init__(self) -> None:
        self.loaded = None
        self.chunk_versions: list[int] = []
        self.gate = threading.Semaphore(0)  # the test lets chunks through one at a time

    def load_snapshot(self, snapshot) -> None:
        self.loaded = snapshot

    def sample(self, policy, tokenizer, prompt_ids, prompt_mask, settings, group_size, with_logprobs=False,
               synced_gpus=False, seed=0):  # fmt: skip
        self.gate.acquire()
        self.chunk_versions.append(self.loaded)
        rows = prompt_ids.shape[0]
        ids = torch.full((rows, settings.max_new_tokens), 5)
        return EngineSamples(ids, torch.zeros(rows, dtype=torch.bool), torch.full(ids.shape, -0.5))


def _producer(engine: ChunkEngine) -> StreamingProducer:
    tokenizer = TinyQwen3(**TINY).load_tokenizer()
    model = SimpleNamespace(tokenizer=tokenizer, policy=None)
    scoring = Scoring([lambda prompts, completions, **_: [float(len(c)) for c in completions]], [1.0])
    return StreamingProducer(engine, model, scoring, SamplingSettings(LENGTH, 1.0), G, P, BOUND, 2,
                             lambda n: (f"{n}+1=", {"answer": str(n + 1)}), seed=0)  # fmt: skip


def test_admission_by_hand():
    # group n trains at version n // P: with weights of version v loaded, groups up to (v + bound + 1) * P - 1
    assert [admissible(n, 0, 2, 1) for n in range(5)] == [True, True, True, True, False]
    assert admissible(5, 1, 2, 1) and not admissible(6, 1, 2, 1)
    assert [admissible(n, 0, 2, 0) for n in range(3)] == [True, True, False]  # bound 0: on-policy


def test_tokens_carry_their_version_and_none_exceeds_the_bound():
    engine = ChunkEngine()
    producer = _producer(engine)
    try:
        producer.push_weights(0, 0)
        engine.gate.release(1)  # one chunk (2 of 6 tokens) under version 0, for groups 0-3 (rounds 0 and 1)
        round_0 = _take_with_chunks(producer, engine, 0, weights={1: 1})  # version 1 arrives after that chunk
        rollout = groups_rollout(round_0, producer.model.tokenizer, "cpu")
        versions = rollout.policy_versions  # [N, R]
        assert versions.shape == (P * G, LENGTH)
        # every sample began under version 0 and was finished under version 1 (a partial rollout), in order
        assert versions[:, 0].eq(0).all() and versions[:, -1].eq(1).all()
        assert (versions[:, 1:] >= versions[:, :-1]).all()
        assert float(partial_fraction(versions)) == 1.0
        assert rollout.rewards.tolist() == [6.0] * (P * G)  # scored when the group finished: 6 characters each
        assert (rollout.engine_logprobs == -0.5).all() and rollout.response_mask.all()
        # under version 0 the producer admitted rounds 0 and 1 only (groups 0-3): a group of round 2, trained at
        # version 2, would have been two versions old; its samples started under version 1
        _take_with_chunks(producer, engine, 1, weights={})
        round_2 = groups_rollout(_take_with_chunks(producer, engine, 2, weights={}), producer.model.tokenizer, "cpu")
        assert round_2.policy_versions.min() == 1
    finally:
        _finish(producer, engine)


def test_state_keeps_finished_groups_and_regenerates_those_in_flight():
    engine = ChunkEngine()
    producer = _producer(engine)
    try:
        producer.push_weights(0, 0)
        engine.gate.release(3)  # three chunks: the first four groups finish
        _wait(lambda: len(producer.finished) == 4)
        state = producer.state_dict()
    finally:
        _finish(producer, engine)
    assert sorted(group["index"] for group in state["finished"]) == [0, 1, 2, 3]
    restored = _producer(ChunkEngine())
    restored.load_state_dict(state)
    assert sorted(restored.finished) == [0, 1, 2, 3] and restored.next_index == state["next_index"]
    assert restored.finished[2].tokens == [[5] * LENGTH] * G


def _take_with_chunks(producer, engine, round_index, weights):
    """Let chunks through (pushing ``weights`` {chunks done: version} on the way) until the round is finished."""
    done = 1
    while not all(n in producer.finished for n in range(round_index * P, (round_index + 1) * P)):
        _wait(lambda: len(engine.chunk_versions) >= done)
        if done in weights:
            producer.push_weights(weights[done], weights[done])
        engine.gate.release(1)
        done += 1
    return producer.take_round(round_index)


def _wait(condition, seconds: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _finish(producer, engine) -> None:
    engine.gate.release(1000)  # let the loop run to its next wait, then stop it
    producer.close()

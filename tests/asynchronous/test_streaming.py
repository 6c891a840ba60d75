"""The streaming producer with a scripted engine: admission control keeps every token within the bound, samples
in flight continue under new weights with each token's version recorded, and its state survives a restart."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

from gspo_lightning.asynchronous.rounds import partial_fraction
from gspo_lightning.asynchronous.streaming import StreamingProducer, StreamPlan, admissible, dynamic_sampling_counts
from gspo_lightning.asynchronous.streaming import groups_rollout
from gspo_lightning.engines.base import EngineSamples, SamplingEngine, SamplingSettings
from gspo_lightning.episodes.environment import Environment, Step
from gspo_lightning.episodes.loop import EpisodeRun
from gspo_lightning.models import TinyQwen3
from gspo_lightning.models.char_tokenizer import ASCII_ALPHABET, TOOL_CHAT_TEMPLATE, build_char_tokenizer
from gspo_lightning.moe.routing import NOT_RECORDED
from gspo_lightning.rollout.pipeline import Scoring
from gspo_lightning.rollout.round import RoundSettings
from tests.conftest import TINY

G, P, BOUND, LENGTH = 2, 2, 1, 6
TOOL_TOKENIZER = build_char_tokenizer(ASCII_ALPHABET, chat_template=TOOL_CHAT_TEMPLATE)


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
               synced_gpus=False, seed=0, with_routes=False):  # fmt: skip
        self.gate.acquire()
        self.chunk_versions.append(self.loaded)
        rows = prompt_ids.shape[0] * group_size
        ids = torch.full((rows, settings.max_new_tokens), 5)
        return EngineSamples(ids, torch.zeros(rows, dtype=torch.bool), torch.full(ids.shape, -0.5))


def _plan(engine: SamplingEngine, length: int = LENGTH, environment=None, max_turns: int = 1, **settings):
    tokenizer = TinyQwen3(**TINY).load_tokenizer() if environment is None else TOOL_TOKENIZER
    run = EpisodeRun(engine, None, tokenizer, SamplingSettings(length, 1.0), environment, max_turns, None,
                     with_logprobs=True)  # fmt: skip
    scoring = Scoring([lambda prompts, completions, **_: [float(len(c)) for c in completions]], [1.0])
    context = settings.pop("context", None)
    round_settings = RoundSettings(G, 1, scoring, **settings)
    return StreamPlan(run, round_settings, P, BOUND, 2, seed=0, context=context)


def _producer(engine: ChunkEngine) -> StreamingProducer:
    return StreamingProducer(_plan(engine), lambda n: (f"{n}+1=", {"answer": str(n + 1)}))


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
        rollout = groups_rollout(round_0, producer.plan, "cpu")
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
        round_2 = groups_rollout(_take_with_chunks(producer, engine, 2, weights={}), producer.plan, "cpu")
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
    assert [t.response_ids for t in restored.finished[2].trajectories] == [[5] * LENGTH] * G


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


class TurnEngine(ChunkEngine):
    """A turn is ``5 5 EOS``, taken in two chunks of two: a context ending in 5 gets EOS, any other ``5 5``."""

    def sample(self, policy, tokenizer, prompt_ids, prompt_mask, settings, group_size, with_logprobs=False,
               synced_gpus=False, seed=0, with_routes=False):  # fmt: skip
        self.gate.acquire()
        self.chunk_versions.append(self.loaded)
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        rows = [[eos, pad] if int(last) == 5 else [5, 5] for last in prompt_ids[:, -1] for _ in range(group_size)]
        ids = torch.tensor(rows)  # [A, 2]
        return EngineSamples(ids, ids.eq(eos).any(-1), torch.full(ids.shape, -0.5))


class TwoQuestions(Environment):
    """Asks a second question after the first turn, ends after the second; reward 1 per turn."""

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, turn):
        self.turns = getattr(self, "turns", 0) + 1
        return Step(observation=[{"role": "user", "content": "again"}], reward=1.0, done=self.turns == 2)


def _chat_plan(engine, **settings):
    return _plan(engine, 4, TwoQuestions, 3, **settings)


def test_streamed_episodes_span_versions_and_train_only_the_policy_tokens():
    engine = TurnEngine()
    producer = StreamingProducer(_chat_plan(engine), lambda n: (f"{n}+1=", {}))
    try:
        producer.push_weights(0, 0)
        engine.gate.release(1)  # the first turn's first chunk under version 0
        groups = _take_with_chunks(producer, engine, 0, weights={1: 1})
        rollout = groups_rollout(groups, producer.plan, "cpu")
    finally:
        _finish(producer, engine)
    assert rollout.episodes is not None and rollout.episodes.turns.tolist() == [2] * (P * G)
    policy = rollout.response_mask.bool()  # [N, R]
    assert int(policy.sum(-1)[0]) == 6  # two turns of three tokens; the observation between them is not trained
    assert (rollout.response_attention.sum(-1) > policy.sum(-1)).all()
    versions = rollout.policy_versions  # [N, R]
    assert versions[~policy].eq(-1).all()
    # the second chunk was already asked for when version 1 arrived: the first turn is version 0's, the second
    # version 1's (new weights loaded at a chunk boundary, in the middle of the episode)
    assert versions[0][policy[0]].tolist() == [0, 0, 0, 1, 1, 1]
    assert rollout.rewards.tolist() == [float(len(groups[0].trajectories[0].final_answer))] * (P * G)


def test_an_uninformative_group_gives_its_slot_to_a_new_prompt():
    engine = ChunkEngine()
    plan = _plan(engine, dynamic_sampling=True, max_extra_draws=1)
    producer = StreamingProducer(plan, lambda n: (f"{n}+1=", {}))
    producer.add_refill([("refill a", {}), ("refill b", {})])
    try:
        producer.push_weights(0, 0)
        engine.gate.release(1)
        groups = _take_with_chunks(producer, engine, 0, weights={})
    finally:
        _finish(producer, engine)
    # every sample scores its length: all groups are uninformative, so each slot drew once more, then kept it
    assert [g.prompt for g in groups] == ["refill a", "refill b"] and [g.draws for g in groups] == [1, 1]
    assert dynamic_sampling_counts(groups, G) == {"groups_drawn": 4, "groups_dropped": 4, "groups_kept": 0,
                                                  "extra_draws": 2}  # fmt: skip
    assert producer.refill == []


@pytest.mark.parametrize("overflow", ["truncate", "skip"])
def test_an_overlong_prompt_is_cut_to_fit_and_counted(overflow):
    engine = ChunkEngine()
    plan = _plan(engine, context=LENGTH + 3, prompt_overflow=overflow)
    producer = StreamingProducer(plan, lambda n: ("a much longer prompt" if n == 0 else "1=", {}))
    try:
        producer.push_weights(0, 0)
        engine.gate.release(1)
        rollout = groups_rollout(_take_with_chunks(producer, engine, 0, weights={}), plan, "cpu")
    finally:
        _finish(producer, engine)
    assert rollout.prompt_cut.tolist() == [True] * G + [False] * G
    assert rollout.prompt_mask.sum(-1).max() == 3
    assert (rollout.prompt_skipped is not None) == (overflow == "skip")


class RouteChunkEngine(ChunkEngine):
    """``ChunkEngine`` that also reports routes (R3): every token a call read gets the call's number as its one
    expert, the call's last sampled token (read by no forward of it) ``NOT_RECORDED``."""

    records_routes = True

    def sample(self, policy, tokenizer, prompt_ids, prompt_mask, settings, group_size, with_logprobs=False,
               synced_gpus=False, seed=0, with_routes=False):  # fmt: skip
        samples = super().sample(policy, tokenizer, prompt_ids, prompt_mask, settings, group_size, with_logprobs)
        call = len(self.chunk_versions)  # 1, 2, ...
        read = torch.cat([prompt_mask.repeat_interleave(group_size, 0), torch.ones_like(samples.response_ids)], 1)
        read[:, -1] = 0  # [A, Lc + R]
        routes = torch.where(read.bool(), call, NOT_RECORDED).to(torch.int16)  # [A, Lc + R]
        samples.routes = routes[:, None, :, None]  # [A, layers 1, Lc + R, k 1]
        return samples


def test_streamed_routes_come_from_the_call_that_first_read_each_token_and_survive_a_restart():
    engine = RouteChunkEngine()
    plan = _plan(engine)
    plan = replace(plan, run=replace(plan.run, with_routes=True))
    producer = StreamingProducer(plan, lambda n: (f"{n}+1=", {"answer": str(n + 1)}))
    try:
        producer.push_weights(0, 0)
        engine.gate.release(1)
        groups = _take_with_chunks(producer, engine, 0, weights={1: 1})  # chunks of 2 tokens over two versions
        engine.gate.release(3)
        _wait(lambda: len(producer.finished) == P)  # round 1's groups finished too
        state = producer.state_dict()
        kept = {index: [t.routes.clone() for t in group.trajectories] for index, group in producer.finished.items()}
    finally:
        _finish(producer, engine)
    rollout = groups_rollout(groups, plan, "cpu")
    width = rollout.prompt_ids.shape[1]
    for row in range(len(rollout)):
        routes = rollout.routes[row, 0, :, 0]  # [Lp + R]
        prompt = routes[width - int(rollout.prompt_mask[row].sum()) : width]
        response = routes[width:]  # 6 tokens in 3 calls: each call reads its 2 new tokens but the last
        assert (prompt == response[0]).all() and (routes[: width - len(prompt)] == NOT_RECORDED).all()
        first, second, third = response[0], response[1], response[3]
        assert first < second < third  # three different calls, in order
        assert response.tolist() == [first, second, second, third, third, NOT_RECORDED]
    restored = _producer(RouteChunkEngine())
    restored.load_state_dict(state)  # finished groups keep their routes through the checkpoint
    assert sorted(restored.finished) == sorted(kept) == [2, 3]
    for index, routes in kept.items():
        assert all(torch.equal(t.routes, r) for t, r in zip(restored.finished[index].trajectories, routes, strict=True))

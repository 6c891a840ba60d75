"""The round sources that sample ahead (``rollout/source.py``'s ``RoundSource``). ``FixedLagRounds``: at round r's
start the rounds ``schedule.rounds_to_submit(r, lag)`` are sampled with version r's weights (in line, or on a
background thread for an engine of its own, from a snapshot), and round r trains on what version r - lag sampled.
``StreamingRounds``: version r's weights go to the streaming loop (``streaming.py``) and round r trains on its next
P groups. Both end in ``rollout/round.py``'s ``train_round`` with the current weights: pi_old is the proximal
policy, the engine's log-probs the behaviour policy's, and the rollout correction weighs the gap.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

from gspo_lightning.asynchronous.checkpoint import restored_sampled_round, sampled_round_state
from gspo_lightning.asynchronous.metrics import response_lags, version_lag_stats
from gspo_lightning.asynchronous.producer import Job, Producer
from gspo_lightning.asynchronous.schedule import rounds_to_submit
from gspo_lightning.asynchronous.settings import AsyncRollouts
from gspo_lightning.asynchronous.streaming import StreamingProducer, StreamPlan, dynamic_sampling_counts, groups_rollout
from gspo_lightning.engines.base import SamplingEngine
from gspo_lightning.rollout.pipeline import context_length
from gspo_lightning.rollout.round import RoundModel, RoundResult, RoundSettings, round_trajectory_run, sample_round
from gspo_lightning.rollout.round import train_round
from gspo_lightning.rollout.source import RoundRequest, SourcedRound
from gspo_lightning.rollout.types import Minibatch, PromptBatch, Rollout
from gspo_lightning.strategies import inference_context


class FixedLagRounds:
    """``mode: fixed_lag``: the sampled-ahead rounds of one rank and the producer sampling them (see the module
    docstring); a ``rollout/source.py`` ``RoundSource``."""

    seconds_logged = ("trainer_wait_s", "engine_idle_s")

    def __init__(self, settings: AsyncRollouts, engine: SamplingEngine) -> None:
        self.settings = settings
        self.engine = engine
        self.producer = Producer(engine.runs_in_background)
        self._last_finished: float | None = None

    @property
    def runs_in_background(self) -> bool:
        return self.producer.runs_in_background

    def next_round(self, request: RoundRequest) -> SourcedRound:
        """Submit what is due at ``request.index``, then train on its samples: the round, its lag and queue
        figures, and ``trainer_wait_s`` / ``engine_idle_s``."""
        started = time.perf_counter()
        round_index = request.index
        # Round r itself is due when nothing sampled it ahead (a run resumed from a checkpoint without it)
        wanted = sorted({round_index, *rounds_to_submit(round_index, self.settings.lag)})
        due = [index for index in wanted if index not in self.producer]
        if due:
            self._submit(request, due)
        sampled = self.producer.take(round_index)
        waited = time.perf_counter() - started
        idle = 0.0 if self._last_finished is None else max(0.0, sampled.started - self._last_finished)
        self._last_finished = sampled.finished or None
        result, stats = trained(request, request.model(), sampled.rollout, {}, sampled.seconds, self.settings.lag,
                                self.producer.depth)  # fmt: skip
        return SourcedRound(result, stats, {"trainer_wait_s": waited, "engine_idle_s": idle})

    def _submit(self, request: RoundRequest, due: list[int]) -> None:
        trainer, version = request.trainer, request.index
        module = trainer.lightning_module

        def job_of(index: int, before: Callable[[], None] | None = None) -> Job:
            return _sampling_job(self.engine, request.model(), request.settings, request.prompts_of(index),
                                 request.seed_of(index), version, before, request.any_rank)  # fmt: skip

        if self.producer.runs_in_background:
            snapshot = self.engine.snapshot_weights(trainer, module)  # version's weights, taken now
            load: Callable[[], None] = lambda: self.engine.load_snapshot(snapshot)  # noqa: E731
            for index in due:
                self.producer.submit(index, version, job_of(index, load))
            return
        self.engine.before_rollout(trainer, module)  # the engine gets the current weights
        with inference_context(trainer):
            for index in due:
                self.producer.submit(index, version, job_of(index))
        self.engine.after_rollout()

    @contextmanager
    def lend(self) -> Iterator[None]:
        """The engine used from the trainer's thread: the work in flight finishes first; each later job loads its
        own snapshot, so nothing is restored afterwards."""
        self.producer.drain()
        yield

    def state_dict(self) -> list[dict[str, Any]]:
        """This rank's sampled rounds not yet trained (waits for those in flight)."""
        return [sampled_round_state(sampled) for sampled in self.producer.finished()]

    def load_state_dict(self, state: list[dict[str, Any]] | None) -> None:
        self.producer.restore([restored_sampled_round(entry) for entry in state or []])
        self._last_finished = None

    def close(self) -> None:
        """Stop the producer (a later fit gets a fresh one)."""
        self.producer.close()
        self.producer = Producer(self.producer.runs_in_background)


def _sampling_job(
    engine: SamplingEngine, model: RoundModel, settings: RoundSettings, batch: PromptBatch, seed: int, version: int,
    before: Callable[[], None] | None = None, any_rank: Callable[[bool], bool] = bool,
) -> Job:  # fmt: skip
    def job() -> tuple[Rollout, dict[str, float]]:
        if before is not None:
            before()
        seconds: dict[str, float] = {}
        rollout, _ = sample_round(engine, model, settings, batch, seed, seconds, any_rank=any_rank)
        return with_policy_versions(rollout, version), seconds

    return job


def with_policy_versions(rollout: Rollout, version: int) -> Rollout:
    """``rollout`` with every policy token marked as sampled by ``version`` (-1 on the others)."""
    mask = rollout.response_mask != 0  # [N, R]
    versions = torch.where(mask, torch.full_like(rollout.response_ids, version), -1)  # [N, R]
    return replace(rollout, policy_versions=versions)


class StreamingRounds:
    """``mode: streaming``: a ``StreamingProducer`` generates without pause; each round pushes the trainer's weights
    to it and trains on its P next groups (``asynchronous/streaming.py``); a ``rollout/source.py`` ``RoundSource``."""

    runs_in_background = True
    seconds_logged = ("trainer_wait_s", "engine_idle_s")

    def __init__(self, settings: AsyncRollouts, engine: SamplingEngine) -> None:
        self.settings = settings
        self.engine = engine
        self.producer: StreamingProducer | None = None
        self._restored: dict[str, Any] | None = None
        self._batches: dict[int, PromptBatch] = {}

    def next_round(self, request: RoundRequest) -> SourcedRound:
        current, trainer, round_index = request.model(), request.trainer, request.index
        if self.producer is None:
            self.producer = self._start(current, request)
        if request.draw_prompts is not None and len(self.producer.refill) < len(request.batch):
            more = request.draw_prompts()  # on this thread: the data module's stream and the checkpoint agree
            self.producer.add_refill([(prompt, {name: values[i] for name, values in more.columns.items()})
                                      for i, prompt in enumerate(more.prompts)])  # fmt: skip
        started = time.perf_counter()
        self.producer.push_weights(round_index, self.engine.snapshot_weights(trainer, trainer.lightning_module))
        groups = self.producer.take_round(round_index)
        waited = time.perf_counter() - started
        rollout = groups_rollout(groups, self.producer.plan, current.device)
        counts = dynamic_sampling_counts(groups, request.settings.group_size) if request.draw_prompts else {}
        seconds = self.producer.take_seconds()
        result, stats = trained(request, current, rollout, counts, seconds, self.settings.max_staleness,
                                self.producer.depth)  # fmt: skip
        stats["partial_frac"] = partial_fraction(rollout.policy_versions)
        return SourcedRound(result, stats, {"trainer_wait_s": waited})

    def _start(self, model: RoundModel, request: RoundRequest) -> StreamingProducer:
        prompts_per_round = len(request.batch)

        def prompt_of(index: int) -> tuple[Any, dict[str, Any]]:
            round_index, slot = divmod(index, prompts_per_round)
            if round_index not in self._batches:
                self._batches = {round_index: request.prompts_of(round_index)}  # rounds are admitted in order
            batch = self._batches[round_index]
            return batch.prompts[slot], {name: values[slot] for name, values in batch.columns.items()}

        plan = StreamPlan(
            run=round_trajectory_run(self.engine, replace(model, engine_logprobs=True, synced_gpus=False),
                                     request.settings),  # fmt: skip
            settings=request.settings,
            prompts_per_round=prompts_per_round,
            max_staleness=self.settings.max_staleness,
            chunk_tokens=self.settings.chunk_tokens,
            seed=request.seed_of(0),
            context=context_length(model.policy, model.tokenizer),
        )
        producer = StreamingProducer(plan, prompt_of)
        if self._restored is not None:
            producer.load_state_dict(self._restored)
        return producer

    @contextmanager
    def lend(self) -> Iterator[None]:
        """The loop waits between chunks until the engine is given back, then loads its own weights again."""
        if self.producer is None:
            yield
            return
        self.producer.pause()
        try:
            yield
        finally:
            self.producer.resume()

    def state_dict(self) -> dict[str, Any]:
        return self.producer.state_dict() if self.producer is not None else (self._restored or {})

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self._restored = state or None

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
            self.producer = None


def trained(
    request: RoundRequest, model: RoundModel, rollout: Rollout, counts: dict[str, int], seconds: dict[str, float],
    bound: int, depth: int,
) -> tuple[RoundResult, dict[str, torch.Tensor]]:  # fmt: skip
    """A sampled-ahead round trained with the current weights (``train_round``), each minibatch with its rows'
    lags, and the round's lag and queue figures (``bound``: the mode's staleness bound)."""
    with inference_context(request.trainer):
        result = train_round(rollout, model, request.settings, counts, seconds)
    assert rollout.policy_versions is not None
    result.minibatches = with_lags(result.minibatches, response_lags(rollout.policy_versions, request.index))
    stats = version_lag_stats(rollout.policy_versions, request.index, bound)
    stats["queue_depth"] = torch.tensor(float(depth))
    return result, stats


def with_lags(minibatches: list[Minibatch], lags: torch.Tensor) -> list[Minibatch]:
    """Each minibatch with its rows' policy lags (``lags`` [N], rows in minibatch order)."""
    out, start = [], 0
    for minibatch in minibatches:
        out.append(replace(minibatch, policy_lag=lags[start : start + len(minibatch)].to(minibatch.input_ids.device)))
        start += len(minibatch)
    return out


def partial_fraction(policy_versions: torch.Tensor) -> torch.Tensor:
    """[] float32: the fraction of responses whose tokens come from more than one policy version."""
    valid = policy_versions >= 0  # [N, R]
    high = torch.where(valid, policy_versions, -1).amax(-1)  # [N]
    low = torch.where(valid, policy_versions, 1 << 30).amin(-1)  # [N]
    has = valid.any(-1)  # [N]
    return ((high > low) & has).float().sum().div(has.sum().clamp(min=1)).cpu()

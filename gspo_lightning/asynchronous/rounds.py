"""A round under ``sampler.asynchronous``: hand the engine the rounds due now, then train on one sampled earlier.

At the start of round r (the trainer's weights are version r):

1. submit: the rounds ``schedule.rounds_to_submit(r, lag)`` are sampled with version r's weights: on the spot
   (``InlineProducer``, an engine sharing the trainer's device) or on a background thread (an engine of its own,
   which gets a snapshot of version r).
2. take: round r's samples, made by version r - lag (waiting for them if the engine is still at it).
3. train: ``rollout/round.py``'s ``train_round`` with the current weights: pi_old is the proximal policy
   (version r), the engine's log-probs are the behaviour policy's, and the rollout correction weighs the gap.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import torch

from gspo_lightning.asynchronous.checkpoint import restored_sampled_round, sampled_round_state
from gspo_lightning.asynchronous.metrics import response_lags, version_lag_stats
from gspo_lightning.asynchronous.producer import Job, make_producer
from gspo_lightning.asynchronous.schedule import rounds_to_submit
from gspo_lightning.asynchronous.settings import AsyncRollouts
from gspo_lightning.asynchronous.streaming import StreamingProducer, groups_rollout
from gspo_lightning.engines.base import SamplingEngine, SamplingSettings
from gspo_lightning.rollout.round import RoundModel, RoundResult, RoundSettings, sample_round, train_round
from gspo_lightning.rollout.types import Minibatch, PromptBatch, Rollout
from gspo_lightning.strategies import inference_context


class AsyncRounds:
    """The sampled-ahead rounds of one rank and the producer sampling them (see the module docstring)."""

    def __init__(self, settings: AsyncRollouts, engine: SamplingEngine) -> None:
        self.settings = settings
        self.engine = engine
        self.producer = make_producer(engine.runs_in_background)
        self._last_finished: float | None = None

    @property
    def runs_in_background(self) -> bool:
        return self.producer.runs_in_background

    def next_round(
        self,
        trainer: pl.Trainer,
        round_index: int,
        model: Callable[[], RoundModel],
        round_settings: RoundSettings,
        prompts_of: Callable[[int], PromptBatch],
        seed_of: Callable[[int], int],
        any_rank: Callable[[bool], bool] = bool,
    ) -> tuple[RoundResult, dict[str, torch.Tensor], dict[str, float]]:
        """Submit what is due at ``round_index``, then train on its samples: the round, its lag and queue figures
        (``rollout/``), and ``trainer_wait_s`` / ``engine_idle_s``. ``any_rank``: as ``run_round``'s (in-line
        sampling under sharded parameters is a collective)."""
        started = time.perf_counter()
        # Round r itself is due when nothing sampled it ahead (a run resumed from a checkpoint without it)
        wanted = sorted({round_index, *rounds_to_submit(round_index, self.settings.lag)})
        due = [index for index in wanted if index not in self.producer]
        if due:
            self._submit(trainer, round_index, due, model, round_settings, prompts_of, seed_of, any_rank)
        sampled = self.producer.take(round_index)
        waited = time.perf_counter() - started
        idle = 0.0 if self._last_finished is None else max(0.0, sampled.started - self._last_finished)
        self._last_finished = sampled.finished or None
        with inference_context(trainer):
            result = train_round(sampled.rollout, model(), round_settings, {}, sampled.seconds)
        assert sampled.rollout.policy_versions is not None
        result.minibatches = with_lags(result.minibatches, response_lags(sampled.rollout.policy_versions, round_index))
        stats = version_lag_stats(sampled.rollout.policy_versions, round_index, self.settings.lag)
        stats["queue_depth"] = torch.tensor(float(self.producer.depth))
        return result, stats, {"trainer_wait_s": waited, "engine_idle_s": idle}

    def _submit(
        self,
        trainer: pl.Trainer,
        version: int,
        due: list[int],
        model: Callable[[], RoundModel],
        round_settings: RoundSettings,
        prompts_of: Callable[[int], PromptBatch],
        seed_of: Callable[[int], int],
        any_rank: Callable[[bool], bool],
    ) -> None:
        module = trainer.lightning_module
        if self.producer.runs_in_background:
            snapshot = self.engine.snapshot_weights(trainer, module)  # version's weights, taken now
            load: Callable[[], None] = lambda: self.engine.load_snapshot(snapshot)  # noqa: E731
            for index in due:
                job = _sampling_job(self.engine, model(), round_settings, prompts_of(index), seed_of(index), version, load)
                self.producer.submit(index, version, job)
            return
        self.engine.before_rollout(trainer, module)  # the engine gets the current weights
        with inference_context(trainer):
            for index in due:
                job = _sampling_job(self.engine, model(), round_settings, prompts_of(index), seed_of(index), version,
                                    any_rank=any_rank)  # fmt: skip
                self.producer.submit(index, version, job)
        self.engine.after_rollout()

    def lend(self) -> None:
        """The engine is about to be used from the trainer's thread: wait for the work in flight."""
        drain = getattr(self.producer, "drain", None)
        if drain is not None:
            drain()

    def give_back(self) -> None:
        """Each job loads its own snapshot: nothing to restore."""

    def state_dict(self) -> list[dict[str, Any]]:
        """This rank's sampled rounds not yet trained (waits for those in flight)."""
        return [sampled_round_state(sampled) for sampled in self.producer.finished()]

    def load_state_dict(self, state: list[dict[str, Any]]) -> None:
        self.producer.restore([restored_sampled_round(entry) for entry in state])
        self._last_finished = None

    def close(self) -> None:
        """Stop the producer (a later fit gets a fresh one)."""
        self.producer.close()
        self.producer = make_producer(self.producer.runs_in_background)


def _sampling_job(
    engine: SamplingEngine,
    model: RoundModel,
    settings: RoundSettings,
    batch: PromptBatch,
    seed: int,
    version: int,
    before: Callable[[], None] | None = None,
    any_rank: Callable[[bool], bool] = bool,
) -> Job:
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
    to it and trains on its P next groups (``asynchronous/streaming.py``)."""

    runs_in_background = True

    def __init__(self, settings: AsyncRollouts, engine: SamplingEngine) -> None:
        self.settings = settings
        self.engine = engine
        self.producer: StreamingProducer | None = None
        self._restored: dict[str, Any] | None = None
        self._batches: dict[int, PromptBatch] = {}

    def next_round(
        self,
        trainer: pl.Trainer,
        round_index: int,
        model: Callable[[], RoundModel],
        round_settings: RoundSettings,
        prompts_of: Callable[[int], PromptBatch],
        seed_of: Callable[[int], int],
        any_rank: Callable[[bool], bool] = bool,
    ) -> tuple[RoundResult, dict[str, torch.Tensor], dict[str, float]]:
        current = model()
        if self.producer is None:
            self.producer = self._start(current, round_settings, prompts_of, seed_of(0), len(prompts_of(round_index)))
        started = time.perf_counter()
        self.producer.push_weights(round_index, self.engine.snapshot_weights(trainer, trainer.lightning_module))
        groups = self.producer.take_round(round_index)
        waited = time.perf_counter() - started
        rollout = groups_rollout(groups, current.tokenizer, current.device)
        with inference_context(trainer):
            result = train_round(rollout, current, round_settings)
        assert rollout.policy_versions is not None
        result.minibatches = with_lags(result.minibatches, response_lags(rollout.policy_versions, round_index))
        stats = version_lag_stats(rollout.policy_versions, round_index, self.settings.max_staleness)
        stats["queue_depth"] = torch.tensor(float(self.producer.depth))
        stats["partial_frac"] = partial_fraction(rollout.policy_versions)
        result.seconds.update(self.producer.take_seconds())
        return result, stats, {"trainer_wait_s": waited}

    def _start(
        self, model: RoundModel, settings: RoundSettings, prompts_of: Callable[[int], PromptBatch], seed: int,
        prompts_per_round: int,
    ) -> StreamingProducer:  # fmt: skip
        def prompt_of(index: int) -> tuple[Any, dict[str, Any]]:
            round_index, slot = divmod(index, prompts_per_round)
            if round_index not in self._batches:
                self._batches = {round_index: prompts_of(round_index)}  # rounds are admitted in order
            batch = self._batches[round_index]
            return batch.prompts[slot], {name: values[slot] for name, values in batch.columns.items()}

        sampling = SamplingSettings(model.max_new_tokens, model.temperature, settings.top_p, settings.top_k)
        producer = StreamingProducer(
            self.engine, model, settings.scoring, sampling, settings.group_size, prompts_per_round,
            self.settings.max_staleness, self.settings.chunk_tokens, prompt_of, seed,
        )  # fmt: skip
        if self._restored is not None:
            producer.load_state_dict(self._restored)
        return producer

    def lend(self) -> None:
        if self.producer is not None:
            self.producer.pause()

    def give_back(self) -> None:
        if self.producer is not None:
            self.producer.resume()  # it loads its own weights again before its next chunk

    def state_dict(self) -> dict[str, Any]:
        return self.producer.state_dict() if self.producer is not None else (self._restored or {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._restored = state or None

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
            self.producer = None


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


def make_rounds(settings: AsyncRollouts, engine: SamplingEngine) -> AsyncRounds | StreamingRounds:
    """The rounds of ``settings.mode`` (fixed lag or streaming)."""
    return StreamingRounds(settings, engine) if settings.mode == "streaming" else AsyncRounds(settings, engine)

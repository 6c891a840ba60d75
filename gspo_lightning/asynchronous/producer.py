"""Where a round's sampling runs: in line (the round waits for it) or on a background thread beside training.

A job samples and scores one round; it is handed to the producer at the start of an earlier round, with the
weights of that moment (``schedule.rounds_to_submit``). ``InlineProducer`` runs it on the spot: the schedule of
policy versions is the asynchronous one, the wall time the synchronous one (an engine sharing the trainer's
device and process). ``BackgroundProducer`` runs jobs one after the other on a thread of their own, for an engine
that computes elsewhere (another process, other devices): the thread mostly waits on that engine while the
trainer trains. Either way a job's result depends on its weights, prompts and seed only, never on timing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from gspo_lightning.rollout.types import Rollout


@dataclass
class SampledRound:
    """One round's samples before training: scored, advantages not yet computed.

    Attributes:
        round_index: the round they are trained in.
        version: the policy version that sampled them (the trainer's weights at the start of that round).
        rollout: the N responses (``policy_versions`` filled).
        seconds: ``generate_s`` and ``reward_s`` of the sampling.
        started / finished: ``time.perf_counter()`` when the engine began and ended the job (this process).
    """

    round_index: int
    version: int
    rollout: Rollout
    seconds: dict[str, float] = field(default_factory=dict)
    started: float = 0.0
    finished: float = 0.0


Job = Callable[[], tuple[Rollout, dict[str, float]]]
"""Samples and scores one round: its rollout and seconds."""


def run_job(round_index: int, version: int, job: Job) -> SampledRound:
    started = time.perf_counter()
    rollout, seconds = job()
    return SampledRound(round_index, version, rollout, seconds, started, time.perf_counter())


class InlineProducer:
    """Runs each job when it is submitted."""

    runs_in_background = False

    def __init__(self) -> None:
        self._done: dict[int, SampledRound] = {}

    def __contains__(self, round_index: int) -> bool:
        return round_index in self._done

    def submit(self, round_index: int, version: int, job: Job) -> None:
        self._done[round_index] = run_job(round_index, version, job)

    def take(self, round_index: int) -> SampledRound:
        """The sampled round (removed from the producer)."""
        if round_index not in self._done:
            raise RuntimeError(f"round {round_index} was never submitted for sampling (have {sorted(self._done)})")
        return self._done.pop(round_index)

    def drain(self) -> None:
        """Wait until no job is in flight (before a checkpoint, an evaluation borrowing the engine, the end)."""

    def finished(self) -> list[SampledRound]:
        """Every sampled round not yet taken, once nothing is in flight (for the checkpoint), in round order."""
        return [self._done[index] for index in sorted(self._done)]

    def restore(self, rounds: list[SampledRound]) -> None:
        self._done = {sampled.round_index: sampled for sampled in rounds}

    @property
    def depth(self) -> int:
        """Sampled (or sampling) rounds waiting to be trained."""
        return len(self._done)

    def close(self) -> None:
        self._done = {}


class BackgroundProducer(InlineProducer):
    """Runs jobs one at a time, in submission order, on a thread of its own; ``take`` waits for its round."""

    runs_in_background = True

    def __init__(self) -> None:
        super().__init__()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gspo-rollout")
        self._futures: dict[int, Future[SampledRound]] = {}

    def __contains__(self, round_index: int) -> bool:
        return round_index in self._futures or super().__contains__(round_index)

    def submit(self, round_index: int, version: int, job: Job) -> None:
        self._futures[round_index] = self._executor.submit(run_job, round_index, version, job)

    def take(self, round_index: int) -> SampledRound:
        future = self._futures.pop(round_index, None)
        if future is not None:
            self._done[round_index] = future.result()  # a job's error is raised here, in the trainer's thread
        return super().take(round_index)

    def drain(self) -> None:
        for index in sorted(self._futures):
            self._done[index] = self._futures.pop(index).result()

    def finished(self) -> list[SampledRound]:
        self.drain()
        return super().finished()

    @property
    def depth(self) -> int:
        return len(self._futures) + len(self._done)

    def close(self) -> None:
        for future in self._futures.values():
            future.cancel()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._futures = {}
        super().close()


def make_producer(background: bool) -> InlineProducer:
    return BackgroundProducer() if background else InlineProducer()

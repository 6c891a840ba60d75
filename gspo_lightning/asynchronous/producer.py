"""Where a round's sampling runs: in line (the round waits for it) or on a background thread beside training.

A job samples and scores one round; it is handed to the producer at the start of an earlier round, with the
weights of that moment (``schedule.rounds_to_submit``). In line, the job runs on the spot: the schedule of
policy versions is the asynchronous one, the wall time the synchronous one (an engine sharing the trainer's
device and process). In the background, jobs run one after the other on a thread of their own, for an engine
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


class Producer:
    """Runs sampling jobs in line (``background`` False: when submitted, in the caller's thread) or one at a time,
    in submission order, on a thread of its own; ``take`` returns a round's samples (waiting for them)."""

    def __init__(self, background: bool) -> None:
        self.runs_in_background = background
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="gspo-rollout") if background else None
        self._rounds: dict[int, Future[SampledRound]] = {}

    def __contains__(self, round_index: int) -> bool:
        return round_index in self._rounds

    def submit(self, round_index: int, version: int, job: Job) -> None:
        if self._executor is not None:
            self._rounds[round_index] = self._executor.submit(run_job, round_index, version, job)
            return
        done: Future[SampledRound] = Future()
        done.set_result(run_job(round_index, version, job))  # a job's error is raised here, in the caller's thread
        self._rounds[round_index] = done

    def take(self, round_index: int) -> SampledRound:
        """The sampled round, removed from the producer (a job's error is raised here, in the trainer's thread)."""
        if round_index not in self._rounds:
            raise RuntimeError(f"round {round_index} was never submitted for sampling (have {sorted(self._rounds)})")
        return self._rounds.pop(round_index).result()

    def drain(self) -> None:
        """Wait until no job is in flight (before a checkpoint, an evaluation borrowing the engine, the end)."""
        for future in self._rounds.values():
            future.exception()

    def finished(self) -> list[SampledRound]:
        """Every sampled round not yet taken, once nothing is in flight (for the checkpoint), in round order."""
        return [self._rounds[index].result() for index in sorted(self._rounds)]

    def restore(self, rounds: list[SampledRound]) -> None:
        self._rounds = {}
        for sampled in rounds:
            self._rounds[sampled.round_index] = done = Future()
            done.set_result(sampled)

    @property
    def depth(self) -> int:
        """Sampled (or sampling) rounds waiting to be trained."""
        return len(self._rounds)

    def close(self) -> None:
        for future in self._rounds.values():
            future.cancel()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        self._rounds = {}

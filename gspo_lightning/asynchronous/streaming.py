"""Streaming rollouts (``mode: streaming``): generation never waits for training, and no token is ever more than
``max_staleness`` policy versions old when it is trained.

The unit is a prompt group (G trajectories of one prompt: single responses or multi-turn episodes) with an
admission index n: prompt n % P of round n // P, trained in round n // P, in admission order. A background thread
advances every admitted, unfinished trajectory by ``chunk_tokens`` with ``episodes/loop.py``'s ``advance`` (the
generator synchronous rounds use, a whole turn at a time), and between chunks loads the newest weights the trainer
pushed: a sample in flight when the weights change continues under the new ones (a partial rollout; an episode's
turns, and even one turn, may span versions), and every policy token records the version that produced it.

Admission control keeps the bound: group n is admitted only while the engine's weights are at least version
n // P - max_staleness. Its tokens are all of that version or newer, and it trains at version n // P, so no token
is older than the bound; finished work is never thrown away (dropping biases training toward short responses).

Dynamic sampling: a finished group whose rewards are all equal is replaced, in its slot n, by the next prompt of
``PromptDataModule.draw_prompts`` (drawn on the trainer's thread, ahead, into ``refill``), at most
``max_extra_draws`` times per slot; the replacement is admitted later, under newer weights, so the bound holds.

Resume: groups finished and not yet trained travel with the checkpoint; groups in flight are saved with their
prompt and regenerated from their start after a restart (environments reset again, with the weights of the resumed
run). No prompt is lost or trained twice; the regenerated samples are new draws, so a streaming run is not bitwise
reproducible (its timing decides which weights each chunk sees).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor

from gspo_lightning.episodes.loop import SEED_STRIDE
from gspo_lightning.episodes.loop import EpisodeRun, EpisodeState, advance, reset_episode
from gspo_lightning.rollout.dynamic_sampling import informative_groups
from gspo_lightning.rollout.trajectories import RolloutLayout, episode_rollout, fitted_responses, score_episodes
from gspo_lightning.rollout.round import RoundSettings
from gspo_lightning.rollout.types import Prompt, Rollout

PromptRow = tuple[Prompt, dict[str, Any]]
"""A prompt and its data columns (one value each)."""


@dataclass(frozen=True)
class StreamPlan:
    """What the streaming loop generates with: the trajectories' run (``make_environment`` None: single
    responses), the round's settings (G, scoring, ``prompt_overflow``, dynamic sampling), P, the bound, the policy's
    context."""

    run: EpisodeRun
    settings: RoundSettings
    prompts_per_round: int
    max_staleness: int
    chunk_tokens: int
    seed: int
    context: int | None = None

    @property
    def single(self) -> bool:
        return self.run.make_environment is None

    @property
    def group_size(self) -> int:
        return self.settings.group_size


@dataclass
class Group:
    """One prompt's G trajectories, as far as they have been generated.

    Attributes:
        index: admission index n (trained in round n // P).
        prompt: the formatted prompt; ``columns``: its data columns (one value each).
        trajectories: the G ``EpisodeState``s (tokens, log-probs, versions, turns).
        draws: prompts drawn for this slot after its first (dynamic sampling).
        rewards / components: once finished, the weighted rewards [G] and each function's scores.
    """

    index: int
    prompt: Prompt
    columns: dict[str, Any]
    trajectories: list[EpisodeState]
    draws: int = 0
    rewards: Tensor | None = None
    components: dict[str, Tensor] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return all(trajectory.done for trajectory in self.trajectories)


def admissible(index: int, loaded_version: int, prompts_per_round: int, max_staleness: int) -> bool:
    """Whether group ``index`` may start under weights of ``loaded_version``: it trains at version index // P, so
    the oldest token it can hold is ``index // P - loaded_version`` versions old."""
    return index // prompts_per_round - loaded_version <= max_staleness


class StreamingProducer:
    """The background generation loop of ``mode: streaming`` (see the module docstring).

    The trainer's side: ``push_weights`` at each round's start, ``add_refill`` (dynamic sampling), ``take_round``
    for the round's P groups, ``state_dict`` / ``load_state_dict`` for checkpoints, ``close``.
    """

    def __init__(self, plan: StreamPlan, prompt_of: Callable[[int], PromptRow]) -> None:
        self.plan, self.prompt_of = plan, prompt_of
        self.next_index = 0
        self.in_flight: dict[int, Group] = {}
        self.finished: dict[int, Group] = {}
        self.refill: list[PromptRow] = []  # dynamic sampling's next prompts, drawn on the trainer's thread
        self.loaded_version = -1
        self._pushed: tuple[int, Any] | None = None
        self._chunks = 0
        self._error: BaseException | None = None
        self._stop = False
        self._paused = False
        self._busy = False
        self._readmit: list[dict[str, Any]] = []  # groups in flight at the checkpoint, regenerated first
        self._current: Any = None  # the snapshot the loop samples with
        self._seconds = {"generate_s": 0.0, "engine_idle_s": 0.0}  # since the last round was taken
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    # ----- the trainer's side -----

    def push_weights(self, version: int, snapshot: Any) -> None:
        """The trainer's weights of ``version`` (an engine snapshot), for the loop to load between chunks."""
        with self._changed:
            self._pushed = (version, snapshot)
            self._changed.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="gspo-streaming", daemon=True)
            self._thread.start()

    def add_refill(self, rows: list[PromptRow]) -> None:
        """More prompts for dynamic sampling's replacements."""
        with self._changed:
            self.refill += rows

    def take_round(self, round_index: int) -> list[Group]:
        """Round ``round_index``'s P groups, in admission order (waits until all are finished)."""
        size = self.plan.prompts_per_round
        wanted = range(round_index * size, (round_index + 1) * size)
        with self._changed:
            self._changed.wait_for(lambda: self._error is not None or all(n in self.finished for n in wanted))
            if self._error is not None:
                raise self._error
            return [self.finished.pop(n) for n in wanted]

    def take_seconds(self) -> dict[str, float]:
        """The loop's ``generate_s`` (chunks, environments, scoring) and ``engine_idle_s`` (waiting) since the last
        call."""
        with self._changed:
            seconds, self._seconds = self._seconds, {"generate_s": 0.0, "engine_idle_s": 0.0}
            return seconds

    @property
    def depth(self) -> int:
        """Groups admitted and not yet trained (finished or in flight)."""
        return len(self.finished) + len(self.in_flight)

    def pause(self) -> None:
        """Wait until the loop is between chunks and keep it there (the engine is lent to the evaluation)."""
        with self._changed:
            self._paused = True
            self._changed.wait_for(lambda: not self._busy)

    def resume(self) -> None:
        """Let the loop go on; it loads its own weights again before its next chunk."""
        with self._changed:
            self._paused = False
            self._changed.notify_all()

    def state_dict(self) -> dict[str, Any]:
        """Finished groups (kept, as plain data), those in flight by prompt (regenerated after a restart) and the
        prompts drawn for replacements."""
        with self._changed:
            return {
                "next_index": self.next_index,
                "finished": [group_state(group) for group in self.finished.values()],
                "in_flight": sorted([*map(admission_state, self.in_flight.values()), *self._readmit],
                                    key=lambda entry: entry["index"]),  # fmt: skip
                "refill": [list(row) for row in self.refill],
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_index = state["next_index"]
        self.finished = {entry["index"]: restored_group(entry) for entry in state["finished"]}
        self._readmit = list(state["in_flight"])
        self.refill = [(prompt, columns) for prompt, columns in state.get("refill", [])]

    def close(self) -> None:
        with self._changed:
            self._stop = True
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join()

    # ----- the loop -----

    def _loop(self) -> None:
        try:
            while True:
                with self._changed:
                    self._busy = False
                    self._changed.notify_all()
                    waiting = time.perf_counter()
                    self._changed.wait_for(
                        lambda: self._stop or (not self._paused and (self._pushed is not None or self._can_work()))
                    )
                    self._seconds["engine_idle_s"] += time.perf_counter() - waiting
                    if self._stop:
                        return
                    pushed, self._pushed = self._pushed, None
                    self._busy = True
                if pushed is not None and pushed[0] > self.loaded_version:
                    self._current, self.loaded_version = pushed[1], pushed[0]
                # nothing to do unless the weights changed, or the engine was lent
                self.plan.run.engine.load_snapshot(self._current)
                working = time.perf_counter()
                self._admit()
                if self.in_flight:
                    self._generate_chunk()
                with self._changed:
                    self._seconds["generate_s"] += time.perf_counter() - working
        except BaseException as error:  # noqa: BLE001 - raised in the trainer's thread by take_round
            with self._changed:
                self._error = error
                self._changed.notify_all()

    def _can_work(self) -> bool:
        return bool(self.in_flight) or self._admissible()

    def _admissible(self) -> bool:
        index = self._readmit[0]["index"] if self._readmit else self.next_index  # the next group to admit
        return self.loaded_version >= 0 and admissible(index, self.loaded_version, self.plan.prompts_per_round,
                                                       self.plan.max_staleness)  # fmt: skip

    def _admit(self) -> None:
        while self._admissible():
            if self._readmit:  # a group in flight at the checkpoint: regenerated from its prompt
                entry = self._readmit[0]
                group = self._new_group(entry["index"], entry["prompt"], entry["columns"], entry["draws"])
            else:
                group = self._new_group(self.next_index, *self.prompt_of(self.next_index))
            with self._changed:
                self.in_flight[group.index] = group
                if self._readmit:
                    self._readmit.pop(0)
                else:
                    self.next_index += 1

    def _new_group(self, index: int, prompt: Prompt, columns: dict[str, Any], draws: int = 0) -> Group:
        """Group ``index``'s G fresh trajectories: environments reset, or the prompt fitted to the context."""
        plan, g = self.plan, self.plan.group_size
        if plan.single:
            trajectories = fitted_responses(plan.run, [prompt], g, plan.context, plan.settings.prompt_overflow)
        else:
            row = {**columns, "prompt": prompt}
            trajectories = [reset_episode(plan.run, row, index * g + j) for j in range(g)]
        return Group(index, prompt, columns, trajectories, draws)

    def _generate_chunk(self) -> None:
        """One step of every unfinished trajectory under the loaded weights, at most ``chunk_tokens`` each."""
        states = [t for group in self.in_flight.values() for t in group.trajectories if not t.done]
        seed = self.plan.seed + SEED_STRIDE * self._chunks
        self._chunks += 1
        advance(self.plan.run, states, list(range(len(states))), seed, self.loaded_version, self.plan.chunk_tokens,
                self.plan.group_size)
        for index in [n for n, group in self.in_flight.items() if group.done]:
            group = self._scored(self.in_flight[index])
            if self._replaces(group):
                prompt, columns = self.refill.pop(0)
                with self._changed:
                    self.in_flight[index] = self._new_group(index, prompt, columns, group.draws + 1)
                continue
            with self._changed:
                self.finished[index] = self.in_flight.pop(index)
                self._changed.notify_all()

    def _scored(self, group: Group) -> Group:
        columns = {name: [value] for name, value in group.columns.items()}
        plan = self.plan
        group.rewards, group.components = score_episodes(group.trajectories, [group.prompt], columns, plan.group_size,
                                                         plan.settings.scoring, plan.single)  # [G]  # fmt: skip
        return group

    def _replaces(self, group: Group) -> bool:
        """Dynamic sampling: an uninformative group gives its slot to a new prompt, while draws are left."""
        settings = self.plan.settings
        if not settings.dynamic_sampling or group.draws >= settings.max_extra_draws:
            return False
        assert group.rewards is not None
        with self._changed:
            return bool(self.refill) and not bool(informative_groups(group.rewards, settings.group_size)[0])


def admission_state(group: Group) -> dict[str, Any]:
    """What regenerates a group in flight after a restart: its slot, its prompt and its draws so far."""
    return {"index": group.index, "prompt": group.prompt, "columns": group.columns, "draws": group.draws}


def group_state(group: Group) -> dict[str, Any]:
    """A finished group as plain data for the checkpoint (its environments left behind)."""
    trajectories = [
        {f.name: getattr(t, f.name) for f in fields(EpisodeState) if f.name != "environment"}
        for t in group.trajectories
    ]
    return admission_state(group) | {"trajectories": trajectories, "rewards": group.rewards,
                                     "components": group.components}  # fmt: skip


def restored_group(entry: dict[str, Any]) -> Group:
    trajectories = [EpisodeState(environment=None, **fields_) for fields_ in entry["trajectories"]]
    return Group(entry["index"], entry["prompt"], entry["columns"], trajectories, entry["draws"], entry["rewards"],
                 entry["components"])  # fmt: skip


def groups_rollout(groups: list[Group], plan: StreamPlan, device: torch.device | str) -> Rollout:
    """A round's P finished groups laid out as a ``Rollout`` (prompt i's G samples at rows i*G .. i*G + G - 1),
    with every policy token's version."""
    trajectories = [t for group in groups for t in group.trajectories]
    rewards = torch.cat([group.rewards for group in groups if group.rewards is not None])  # [N]
    components = {name: torch.cat([group.components[name] for group in groups]) for name in groups[0].components}
    layout = RolloutLayout(plan.single, with_logprobs=True, with_versions=True,
                           skip_cut=plan.single and plan.settings.prompt_overflow == "skip",
                           with_routes=plan.run.with_routes)  # fmt: skip
    return episode_rollout(
        trajectories, [group.prompt for group in groups], rewards, components, plan.group_size, plan.run.tokenizer,
        plan.run.max_turns, layout, device,
    )  # fmt: skip


def dynamic_sampling_counts(groups: list[Group], group_size: int) -> dict[str, int]:
    """Dynamic sampling's figures of one streamed round (``extra_draws``: prompts drawn one at a time)."""
    rewards = torch.cat([group.rewards for group in groups if group.rewards is not None])  # [N]
    kept = int(informative_groups(rewards, group_size).sum())
    draws = sum(group.draws for group in groups)
    return {"groups_drawn": len(groups) + draws, "groups_dropped": draws + len(groups) - kept, "groups_kept": kept,
            "extra_draws": draws}  # fmt: skip

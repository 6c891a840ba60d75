"""Streaming rollouts (``mode: streaming``): generation never waits for training, and no token is ever more than
``max_staleness`` policy versions old when it is trained.

The unit is a prompt group (G samples of one prompt) with an admission index n: prompt n % P of round n // P,
trained in round n // P, in admission order. A background thread generates every admitted, unfinished sample in
chunks of ``chunk_tokens`` (each chunk continues a sample from its prompt and its tokens so far), and between
chunks loads the newest weights the trainer pushed: a sample in flight when the weights change continues under the
new ones (a partial rollout), and every token records the version that produced it.

Admission control keeps the bound: group n is admitted only while the engine's weights are at least version
n // P - max_staleness. Its tokens are all of that version or newer, and it trains at version n // P, so no token
is older than the bound; finished work is never thrown away (dropping biases training toward short responses).

Resume: groups finished and not yet trained travel with the checkpoint; groups in flight are saved by index and
regenerated from their start after a restart (with the weights of the resumed run). No prompt is lost or trained
twice; the regenerated samples are new draws, so a streaming run is not bitwise reproducible (its timing decides
which weights each chunk sees).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gspo_lightning.engines.base import SamplingEngine, SamplingSettings, padded
from gspo_lightning.engines.continuation import SEED_STRIDE, continue_token_lists, new_tokens
from gspo_lightning.rollout.pipeline import Scoring, decode_responses, encode_prompts, repeat_each
from gspo_lightning.rollout.pipeline import response_mask_until_eos
from gspo_lightning.rewards.scoring import score_completions
from gspo_lightning.rollout.types import Prompt, Rollout


@dataclass
class Group:
    """One prompt's G samples, as far as they have been generated.

    Attributes:
        index: admission index n (trained in round n // P).
        prompt: the formatted prompt; ``columns``: its data columns (one value each).
        prompt_ids: its tokens.
        tokens / logprobs / versions: per sample, the tokens so far, the engine's log-probs of them and the policy
            version that produced each.
        ended: per sample, whether it is complete (EOS, or ``max_new_tokens`` reached).
    """

    index: int
    prompt: Prompt
    columns: dict[str, Any]
    prompt_ids: list[int]
    tokens: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]
    ended: list[bool]
    rewards: list[float] = field(default_factory=list)
    components: dict[str, list[float]] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return all(self.ended)


def admissible(index: int, loaded_version: int, prompts_per_round: int, max_staleness: int) -> bool:
    """Whether group ``index`` may start under weights of ``loaded_version``: it trains at version index // P, so
    the oldest token it can hold is ``index // P - loaded_version`` versions old."""
    return index // prompts_per_round - loaded_version <= max_staleness


class StreamingProducer:
    """The background generation loop of ``mode: streaming`` (see the module docstring).

    The trainer's side: ``push_weights`` at each round's start, ``take_round`` for the round's P groups,
    ``state_dict`` / ``load_state_dict`` for checkpoints, ``close``.
    """

    def __init__(
        self,
        engine: SamplingEngine,
        model: Any,
        scoring: Scoring,
        sampling: SamplingSettings,
        group_size: int,
        prompts_per_round: int,
        max_staleness: int,
        chunk_tokens: int,
        prompt_of: Callable[[int], tuple[Prompt, dict[str, Any]]],
        seed: int,
    ) -> None:
        self.engine, self.model, self.scoring, self.sampling = engine, model, scoring, sampling
        self.group_size, self.prompts_per_round = group_size, prompts_per_round
        self.max_staleness, self.chunk_tokens = max_staleness, chunk_tokens
        self.prompt_of, self.seed = prompt_of, seed
        self.next_index = 0
        self.in_flight: dict[int, Group] = {}
        self.finished: dict[int, Group] = {}
        self.loaded_version = -1
        self._pushed: tuple[int, Any] | None = None
        self._chunks = 0
        self._error: BaseException | None = None
        self._stop = False
        self._paused = False
        self._busy = False
        self._readmit: list[int] = []  # groups in flight at the checkpoint, regenerated first
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

    def take_round(self, round_index: int) -> list[Group]:
        """Round ``round_index``'s P groups, in admission order (waits until all are finished)."""
        wanted = range(round_index * self.prompts_per_round, (round_index + 1) * self.prompts_per_round)
        with self._changed:
            self._changed.wait_for(lambda: self._error is not None or all(n in self.finished for n in wanted))
            if self._error is not None:
                raise self._error
            return [self.finished.pop(n) for n in wanted]

    def take_seconds(self) -> dict[str, float]:
        """The loop's ``generate_s`` (chunks, scoring) and ``engine_idle_s`` (waiting) since the last call."""
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
        """Finished groups (kept) and the indices of those in flight (regenerated after a restart)."""
        with self._changed:
            return {
                "next_index": self.next_index,
                "finished": [vars(group).copy() for group in self.finished.values()],
                "in_flight": sorted([*self.in_flight, *self._readmit]),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_index = state["next_index"]
        self.finished = {entry["index"]: Group(**entry) for entry in state["finished"]}
        self._readmit = list(state["in_flight"])

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
                self.engine.load_snapshot(self._current)  # nothing to do unless the weights changed or were lent
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

    def _next_to_admit(self) -> int:
        return self._readmit[0] if self._readmit else self.next_index

    def _admissible(self) -> bool:
        index = self._next_to_admit()
        return self.loaded_version >= 0 and admissible(index, self.loaded_version, self.prompts_per_round,
                                                       self.max_staleness)  # fmt: skip

    def _admit(self) -> None:
        while self._admissible():
            index = self._next_to_admit()
            prompt, columns = self.prompt_of(index)
            ids, mask = encode_prompts(self.model.tokenizer, [prompt], "cpu")  # [1, Lp] x2
            g = self.group_size
            group = Group(index, prompt, columns, ids[0][mask[0].bool()].tolist(), [[] for _ in range(g)],
                          [[] for _ in range(g)], [[] for _ in range(g)], [False] * g)  # fmt: skip
            with self._changed:
                self.in_flight[index] = group
                if self._readmit:
                    self._readmit.pop(0)
                else:
                    self.next_index += 1

    def _generate_chunk(self) -> None:
        """One chunk of every unfinished sample under the loaded weights."""
        rows = [(group, j) for group in self.in_flight.values() for j in range(self.group_size) if not group.ended[j]]
        tokenizer = self.model.tokenizer
        contexts = [group.prompt_ids + group.tokens[j] for group, j in rows]
        chunk = SamplingSettings(self.chunk_tokens, self.sampling.temperature, self.sampling.top_p, self.sampling.top_k)
        seed = self.seed + SEED_STRIDE * self._chunks
        self._chunks += 1
        samples = continue_token_lists(self.engine, self.model.policy, tokenizer, contexts, chunk, seed, True)
        for (group, j), ids, logprobs in zip(rows, samples.response_ids.tolist(), samples.logprobs.tolist()):
            taken = new_tokens(ids, tokenizer.eos_token_id, self.sampling.max_new_tokens - len(group.tokens[j]))
            group.tokens[j] += taken
            group.logprobs[j] += logprobs[: len(taken)]
            group.versions[j] += [self.loaded_version] * len(taken)
            ended = bool(taken) and taken[-1] == tokenizer.eos_token_id
            group.ended[j] = ended or len(group.tokens[j]) >= self.sampling.max_new_tokens or not taken
        for index in [n for n, group in self.in_flight.items() if group.done]:
            self._score(self.in_flight[index])
            with self._changed:
                self.finished[index] = self.in_flight.pop(index)
                self._changed.notify_all()

    def _score(self, group: Group) -> None:
        rows = padded(group.tokens, self.model.tokenizer.pad_token_id)  # [G, R]
        mask, _ = response_mask_until_eos(rows, self.model.tokenizer.eos_token_id)  # [G, R]
        completions = decode_responses(self.model.tokenizer, rows, mask)
        columns = {name: [value] * self.group_size for name, value in group.columns.items()}
        rewards, components = score_completions(
            self.scoring.rewards, self.scoring.weights, [group.prompt] * self.group_size, completions, columns,
            runner=self.scoring.runner, errors=self.scoring.errors, settings=self.scoring.settings,
        )  # fmt: skip
        group.rewards = rewards.tolist()
        group.components = {name: scores.tolist() for name, scores in components.items()}


def groups_rollout(groups: list[Group], tokenizer: Any, device: torch.device | str) -> Rollout:
    """A round's P finished groups laid out as a ``Rollout`` (prompt i's G samples at rows i*G .. i*G + G - 1)."""
    size = len(groups[0].tokens)
    prompt_ids, prompt_mask = encode_prompts(tokenizer, [group.prompt for group in groups], device)  # [P, Lp] x2
    tokens = [sample for group in groups for sample in group.tokens]
    response_ids = padded(tokens, tokenizer.pad_token_id).to(device)  # [N, R]
    response_mask, truncated = response_mask_until_eos(response_ids, tokenizer.eos_token_id)  # [N, R], [N]
    response_mask = response_mask * padded([[1] * len(t) for t in tokens], 0).to(device)  # [N, R] not past the end
    logprobs = padded([lp for g in groups for lp in g.logprobs], 0.0, torch.float32).to(device)  # [N, R]
    versions = padded([v for g in groups for v in g.versions], -1).to(device)  # [N, R]
    components = {name: torch.tensor([s for g in groups for s in g.components[name]]) for name in groups[0].components}
    return Rollout(
        prompt_ids=prompt_ids.repeat_interleave(size, dim=0),  # [N, Lp]
        prompt_mask=prompt_mask.repeat_interleave(size, dim=0),  # [N, Lp]
        response_ids=response_ids,
        response_mask=response_mask,
        rewards=torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32, device=device),  # [N]
        advantages=None,
        truncated=truncated,
        completions=decode_responses(tokenizer, response_ids, response_mask),
        prompts=repeat_each([group.prompt for group in groups], size),
        reward_components=components,
        engine_logprobs=logprobs,
        policy_versions=torch.where(response_mask.bool(), versions, -1),  # [N, R]
    )

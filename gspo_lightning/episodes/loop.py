"""The one generator of trajectories: every sample of a round, a single response or a multi-turn episode, is an
``EpisodeState`` advanced by ``advance`` on the sampling engine.

    reset every environment -> [ engine continues every unfinished trajectory (one batch)
                                 -> a finished turn: its environment answers -> its observation's template tokens ]
                                repeated until every trajectory is done or hit a limit

A single response is a one-turn trajectory with no environment. ``advance`` takes a whole turn (synchronous
rounds) or at most ``chunk`` tokens of it (streaming, which may load new weights between two steps: a turn then
spans versions, each token recording its own in ``versions``). Finished trajectories drop out of the batch.
Every continuation is the trajectory's whole token history (its own sampled ids and the template's, never
re-encoded text), left-padded into one engine call, so vLLM's prefix cache serves what it has seen and the cost of
a turn is the new observation's prefill. No Lightning here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from gspo_lightning.engines.base import EngineSamples, SamplingEngine, SamplingSettings, padded
from gspo_lightning.episodes.environment import (
    Environment,
    EnvironmentFactory,
    Message,
    Step,
    ToolEnvironment,
    ToolError,
)
from gspo_lightning.episodes.rendering import first_context, observation_ids
from gspo_lightning.moe.rollout_routes import call_segment, first_read
from gspo_lightning.validation import UserCodeError, qualified_name

logger = logging.getLogger(__name__)

SEED_STRIDE = 1_000_003
"""Between the seeds of successive engine calls (turns, chunks): call k seeds its rows from seed + k * stride, so no
two calls share a random stream."""


class EpisodeError(RuntimeError):
    """An environment or a tool failed in an episode, under ``sampler.reward_errors: raise``."""


class EpisodeCodeError(EpisodeError, UserCodeError):
    """The user's tool or environment raised: the command line names its setting (``sampler.episodes.tools[i]``,
    ``sampler.episodes.environment``), the function, the error and the episode, and shows the code's own frames."""


@dataclass(eq=False)
class EpisodeState:
    """One episode as it unfolds: its tokens (ids, never text), who wrote each, and what happened.

    The response is everything after the first context: ``response_ids`` with ``policy_mask`` 1 where the
    policy wrote the token (its engine log-prob in ``logprobs``, its turn in ``turn_of``, the policy version that
    sampled it in ``versions``) and 0 where the template, a tool or the environment did (``turn_of`` and
    ``versions`` -1), and, recording experts (``model.routing_replay: rollout``), ``routes``: each token's experts
    from the engine forward that first read it. ``environment`` None: a single response (one turn, nothing answers
    it).
    """

    environment: Environment | None
    messages: list[Message]
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    policy_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_of: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routes: Tensor | None = None  # [layers, T, k] experts of its first T tokens as first read (R3; else None)
    turn_rewards: list[float] = field(default_factory=list)
    turn_tokens: int = 0  # the current turn's tokens so far (a turn taken in chunks)
    prompt_cut: bool = False  # the prompt was cut to fit the context (sampler.prompt_overflow)
    tool_calls: int = 0
    tool_errors: int = 0
    done: bool = False
    truncated_by: str | None = None  # "turns", "turn_tokens" or "context"
    failure: str | None = None
    final_answer: str = ""

    @property
    def turns(self) -> int:
        return len(self.turn_rewards)

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def append(self, ids: list[int], policy: bool, logprobs: list[float] | None = None, version: int = 0) -> None:
        self.response_ids += ids
        self.policy_mask += [int(policy)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.turn_of += [self.turns if policy else -1] * len(ids)
        self.versions += [version if policy else -1] * len(ids)

    def stop(self, truncated_by: str | None = None) -> None:
        self.done, self.truncated_by = True, truncated_by


@dataclass(frozen=True)
class EpisodeRun:
    """What one batch of trajectories runs with: the engine and policy, a turn's sampling, the limits.

    ``make_environment`` None: single responses (``max_turns`` 1). ``budget`` is the most tokens an episode holds
    (prompt included; None: no limit but the turns'). ``errors`` is ``sampler.reward_errors``: ``raise`` or
    ``skip``.
    """

    engine: SamplingEngine
    policy: nn.Module
    tokenizer: PreTrainedTokenizerBase
    sampling: SamplingSettings
    make_environment: EnvironmentFactory | None
    max_turns: int
    budget: int | None
    errors: str = "raise"
    with_logprobs: bool = False
    synced_gpus: bool = False
    device: Any = "cpu"
    with_routes: bool = False  # the engine reports each token's experts (Rollout Routing Replay)


def run_episodes(
    run: EpisodeRun, prompts: list[Any], columns: dict[str, list[Any]], group_size: int, seed: int,
    any_rank: Callable[[bool], bool] = bool,
) -> list[EpisodeState]:  # fmt: skip
    """``group_size`` episodes per prompt (prompt i's at i*G .. i*G + G - 1), each run to its end. ``any_rank``
    turns this rank's "I have episodes going" into all ranks' decision (a collective under sharded sampling)."""
    episodes = [
        reset_episode(run, {**{name: values[i] for name, values in columns.items()}, "prompt": prompt}, index)
        for i, prompt in enumerate(prompts)
        for index in range(i * group_size, (i + 1) * group_size)
    ]
    for turn in range(run.max_turns):
        active = [index for index, episode in enumerate(episodes) if not episode.done]
        if not any_rank(bool(active)):  # sharded sampling is a collective: every rank samples as long as any does
            break
        advance(run, episodes, active, seed + turn * SEED_STRIDE)
    return episodes


def advance(
    run: EpisodeRun, states: list[EpisodeState], active: list[int], seed: int, version: int = 0,
    chunk: int | None = None, group_size: int = 1,
) -> None:  # fmt: skip
    """One step of the ``active`` trajectories (indices into ``states``, their row numbers in errors): the rest of
    each one's turn, or at most ``chunk`` tokens of it, sampled by policy ``version``; each whose turn ended is
    answered by its environment (or, a single response, is done). Single responses not yet started, in blocks of
    ``group_size`` of one prompt, are sampled as one prompt with ``group_size`` continuations (one prefill)."""
    fresh = _fresh_groups(states, active, group_size)
    rest = [index for index in active if index not in set(fresh)]
    calls = [(fresh[::group_size], group_size, fresh)] if fresh else []  # each block's prompt once, G continuations
    calls += [(group, 1, group) for group in (_budget_groups(run, states, rest, chunk) if rest or not fresh else [])]
    offset = 0
    for firsts, continuations, rows in calls:
        samples = _continue(run, [states[index] for index in firsts], continuations, seed + offset, chunk)
        for row, index in enumerate(rows):
            _take_turn(run, states[index], samples, row, version, chunk)
        offset += len(rows)  # every request of a step draws from its own seeded stream
    for index in active:
        episode = states[index]
        if episode.done or episode.turn_tokens:  # finished, or its turn goes on in the next chunk
            continue
        if episode.environment is None:
            episode.stop()  # a single response: one turn
        else:
            _answer(run, episode, index)


def _fresh_groups(states: list[EpisodeState], active: list[int], group_size: int) -> list[int]:
    """The active single responses not yet started, as whole blocks of ``group_size`` sharing one prompt."""
    if group_size < 2:
        return []
    fresh = [i for i in active if states[i].environment is None and not states[i].response_ids]
    blocks = [fresh[start : start + group_size] for start in range(0, len(fresh), group_size)]
    whole = [block for block in blocks if len(block) == group_size and block[-1] - block[0] == group_size - 1
             and all(states[i].prompt_ids == states[block[0]].prompt_ids for i in block)]  # fmt: skip
    return [index for block in whole for index in block]


def reset_episode(run: EpisodeRun, row: dict[str, Any], index: int) -> EpisodeState:
    """Episode ``index`` of a batch, its environment reset with ``row`` (the prompt and its data columns)."""
    assert run.make_environment is not None, "single responses start from their prompt's tokens"
    environment = run.make_environment()
    try:
        messages = environment.reset(row)
    except Exception as error:
        episode = EpisodeState(environment, [], [run.tokenizer.eos_token_id])  # one real token keeps the row valid
        _fail(run, episode, index, "reset", error)
        return episode
    prompt_ids = first_context(run.tokenizer, messages, environment.tools)
    episode = EpisodeState(environment, list(messages), prompt_ids)
    if run.budget is not None and len(prompt_ids) >= run.budget:
        raise EpisodeError(
            f"episode {index}: its first messages take {len(prompt_ids)} tokens, leaving no room for a turn within "
            f"the episode's {run.budget} tokens (sampler.episodes.max_episode_tokens, or the policy's context)"
        )
    return episode


def _remaining(run: EpisodeRun, episode: EpisodeState, chunk: int | None = None) -> int:
    """Tokens the episode's current turn may still take (at most ``chunk`` in this step)."""
    room = run.sampling.max_new_tokens - episode.turn_tokens
    if run.budget is not None:
        room = min(room, run.budget - len(episode))
    return room if chunk is None else min(room, chunk)


def _budget_groups(
    run: EpisodeRun, episodes: list[EpisodeState], active: list[int], chunk: int | None = None
) -> list[list[int]]:
    """The active episodes by the tokens their next turn may take, one engine call each: no call then asks for more
    than any of its episodes has room for (most have the whole ``max_new_tokens``, so most turns are one call).
    Sharded sampling is a collective with a fixed number of calls: one call, each episode cut to its room."""
    if run.synced_gpus:
        return [active]
    groups: dict[int, list[int]] = {}
    for index in active:
        groups.setdefault(_remaining(run, episodes[index], chunk), []).append(index)
    return [groups[budget] for budget in sorted(groups, reverse=True)] or [[]]


def _continue(
    run: EpisodeRun, states: list[EpisodeState], group_size: int, seed: int, chunk: int | None
) -> EngineSamples:
    """One engine call: ``group_size`` continuations of each state's whole history, as long as the roomiest needs
    (an empty list still makes the call, with one pad token, as a rank with nothing to do under sharded sampling
    must)."""
    budget = max((_remaining(run, state, chunk) for state in states), default=1)
    settings = SamplingSettings(budget, run.sampling.temperature, run.sampling.top_p, run.sampling.top_k)
    pad = run.tokenizer.pad_token_id
    contexts = [state.prompt_ids + state.response_ids for state in states] or [[pad]]
    ids = padded(contexts, pad, left=True).to(run.device)  # [A, L]
    mask = padded([[1] * len(context) for context in contexts], 0, left=True).to(run.device)  # [A, L]
    return run.engine.sample(run.policy, run.tokenizer, ids, mask, settings, group_size, run.with_logprobs,
                             run.synced_gpus, seed, with_routes=run.with_routes)  # fmt: skip


def new_tokens(row: list[int], eos_token_id: int, room: int) -> list[int]:
    """A continuation's tokens up to and including its first EOS (the engine pads after it), at most ``room``.

    A row without EOS ran to the call's ``max_new_tokens``, the longest of the batch: every token of it was
    sampled (a pad id among them too), and each lines up with its log-prob."""
    if eos_token_id in row:
        row = row[: row.index(eos_token_id) + 1]
    return row[:room]


def _take_turn(
    run: EpisodeRun, episode: EpisodeState, samples: EngineSamples, row: int, version: int = 0,
    chunk: int | None = None,
) -> None:  # fmt: skip
    """Append the sampled tokens (up to and including EOS, within the turn's and the episode's room) as policy
    tokens; a turn that ended (EOS, or out of room) becomes the assistant's message."""
    eos = run.tokenizer.eos_token_id
    step_room, room, before = _remaining(run, episode, chunk), _remaining(run, episode), episode.turn_tokens
    tokens = new_tokens(samples.response_ids[row].tolist(), eos, step_room)
    logprobs = samples.logprobs[row, : len(tokens)].tolist() if samples.logprobs is not None else None
    if samples.routes is not None:  # before the tokens join the episode: the context is what the call read
        width = samples.response_ids.shape[1]
        episode.routes = first_read(episode.routes, call_segment(samples.routes, row, len(episode), len(tokens), width))
    episode.append(tokens, policy=True, logprobs=logprobs, version=version)
    episode.turn_tokens += len(tokens)
    ended = bool(tokens) and tokens[-1] == eos
    if not ended and tokens and len(tokens) == step_room < room:
        return  # the chunk ran out, the turn goes on in the next step
    turn, episode.turn_tokens = episode.response_ids[len(episode.response_ids) - episode.turn_tokens :], 0
    text = run.tokenizer.decode(turn, skip_special_tokens=True)
    episode.messages.append({"role": "assistant", "content": text})
    episode.final_answer = text
    if not ended:  # cut: by the turn's budget, or by what was left of the episode's (room at the turn's start)
        episode.turn_rewards.append(0.0)
        episode.stop("context" if room + before < run.sampling.max_new_tokens else "turn_tokens")


def _answer(run: EpisodeRun, episode: EpisodeState, index: int) -> None:
    """The environment's answer to the turn just taken, and its observation's tokens when the episode goes on."""
    try:
        step = episode.environment.step(episode.final_answer)
    except Exception as error:
        episode.turn_rewards.append(0.0)
        _fail(run, episode, index, f"turn {episode.turns - 1}", error)
        return
    _check_step(step, episode, index)
    episode.turn_rewards.append(float(step.reward))
    episode.tool_calls += step.tool_calls
    episode.tool_errors += step.tool_errors
    if step.done:
        episode.stop()
        return
    if episode.turns >= run.max_turns:
        episode.stop("turns")
        return
    observation = list(step.observation or [])
    ids = observation_ids(run.tokenizer, episode.messages, observation, episode.environment.tools)
    if run.budget is not None and len(episode) + len(ids) >= run.budget:  # no room left for another turn
        episode.stop("context")
        return
    episode.append(ids, policy=False)
    episode.messages += observation


def _check_step(step: Any, episode: EpisodeState, index: int) -> None:
    name = type(episode.environment).__name__
    if not isinstance(step, Step):
        raise EpisodeError(f"episode {index}: {name}.step must return a Step, got {type(step).__name__}")
    if not step.done and not step.observation:
        raise EpisodeError(
            f"episode {index}: {name}.step returned no observation for an episode that is not done: return "
            "Step(observation=[...]) or Step(done=True)"
        )


def _fail(run: EpisodeRun, episode: EpisodeState, index: int, where: str, error: Exception) -> None:
    name = type(episode.environment).__name__
    message = f"episode {index} ({name}, {where}): {type(error).__name__}: {error}"
    if run.errors == "raise":
        note = f"{message} (sampler.reward_errors: skip leaves such episodes' groups out)"
        raise _stopping_error(note, episode.environment, f"episode {index}, {where}", error) from error
    logger.warning("%s; its group is left out of learning (sampler.reward_errors: skip)", message)
    episode.failure = message
    episode.stop()


def _stopping_error(message: str, environment: Environment, context: str, error: Exception) -> EpisodeError:
    """What a failed episode stops the run with: naming the setting of the user's code that raised, when it was
    the user's (a tool, an environment's ``reset`` or ``step``); the tool loop's own failures stay ``EpisodeError``."""
    if isinstance(error, ToolError) and error.tool is not None:
        raised = error.__cause__ if error.__cause__ is not None else error
        setting, function = f"sampler.episodes.tools[{error.position}]", qualified_name(error.tool.function)
        return EpisodeCodeError(message, setting, function, raised, context, detail=f"the call {error.call!r}")
    if isinstance(environment, ToolEnvironment):
        return EpisodeError(message)
    method = "reset" if context.endswith("reset") else "step"
    function = f"{qualified_name(environment)}.{method}"
    return EpisodeCodeError(message, "sampler.episodes.environment", function, error, context)

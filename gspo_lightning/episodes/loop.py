"""The episode loop: all P x G episodes advance together, turn by turn, on the sampling engine.

    reset every environment -> [ engine samples one turn for every unfinished episode (one batch)
                                 -> each environment answers its turn -> its observation's template tokens ]
                                repeated until every episode is done or hit a limit

Finished episodes drop out of the batch. Every continuation is the episode's whole token history (its own
sampled ids and the template's, never re-encoded text), so vLLM's prefix cache serves what it has seen, and the
cost of a turn is the new observation's prefill. No Lightning here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from transformers import PreTrainedTokenizerBase

from gspo_lightning.engines.base import EngineSamples, SamplingEngine, SamplingSettings
from gspo_lightning.engines.continuation import SEED_STRIDE, continue_token_lists, new_tokens
from gspo_lightning.episodes.environment import (
    Environment,
    EnvironmentFactory,
    Message,
    Step,
    ToolEnvironment,
    ToolError,
)
from gspo_lightning.episodes.rendering import first_context, observation_ids
from gspo_lightning.validation import UserCodeError, qualified_name

logger = logging.getLogger(__name__)



class EpisodeError(RuntimeError):
    """An environment or a tool failed in an episode, under ``sampler.reward_errors: raise``."""


class EpisodeCodeError(EpisodeError, UserCodeError):
    """The user's tool or environment raised: the command line names its setting (``sampler.episodes.tools[i]``,
    ``sampler.episodes.environment``), the function, the error and the episode, and shows the code's own frames."""


@dataclass(eq=False)
class EpisodeState:
    """One episode as it unfolds: its tokens (ids, never text), who wrote each, and what happened.

    The response is everything after the first context: ``response_ids`` with ``policy_mask`` 1 where the
    policy wrote the token (its engine log-prob in ``logprobs``, its turn in ``turn_of``) and 0 where the
    template, a tool or the environment did (``turn_of`` -1).
    """

    environment: Environment
    messages: list[Message]
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    policy_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_of: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
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

    def append(self, ids: list[int], policy: bool, logprobs: list[float] | None = None) -> None:
        self.response_ids += ids
        self.policy_mask += [int(policy)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.turn_of += [self.turns if policy else -1] * len(ids)

    def stop(self, truncated_by: str | None = None) -> None:
        self.done, self.truncated_by = True, truncated_by


@dataclass(frozen=True)
class EpisodeRun:
    """What one batch of episodes runs with: the engine and policy, a turn's sampling, the limits.

    ``budget`` is the most tokens an episode holds (prompt included; None: no limit but the turns').
    ``errors`` is ``sampler.reward_errors``: ``raise`` or ``skip``.
    """

    engine: SamplingEngine
    policy: nn.Module
    tokenizer: PreTrainedTokenizerBase
    sampling: SamplingSettings
    make_environment: EnvironmentFactory
    max_turns: int
    budget: int | None
    errors: str = "raise"
    with_logprobs: bool = False
    synced_gpus: bool = False
    device: Any = "cpu"


def run_episodes(
    run: EpisodeRun,
    prompts: list[Any],
    columns: dict[str, list[Any]],
    group_size: int,
    seed: int,
    any_rank: Callable[[bool], bool] = bool,
) -> list[EpisodeState]:
    """``group_size`` episodes per prompt (prompt i's at i*G .. i*G + G - 1), each run to its end. ``any_rank``
    turns this rank's "I have episodes going" into all ranks' decision (a collective under sharded sampling)."""
    episodes = [
        _reset(run, {**{name: values[i] for name, values in columns.items()}, "prompt": prompt}, index)
        for i, prompt in enumerate(prompts)
        for index in range(i * group_size, (i + 1) * group_size)
    ]
    for turn in range(run.max_turns):
        active = [index for index, episode in enumerate(episodes) if not episode.done]
        if not any_rank(bool(active)):  # sharded sampling is a collective: every rank samples as long as any does
            break
        offset = 0
        for group in _budget_groups(run, episodes, active):
            samples = _sample_turn(run, [episodes[index] for index in group], seed + turn * SEED_STRIDE + offset)
            for row, index in enumerate(group):
                _take_turn(run, episodes[index], samples, row)
            offset += len(group)  # every request of a turn draws from its own seeded stream
        for index in active:
            if not episodes[index].done:
                _answer(run, episodes[index], index)
    return episodes


def _reset(run: EpisodeRun, row: dict[str, Any], index: int) -> EpisodeState:
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


def _remaining(run: EpisodeRun, episode: EpisodeState) -> int:
    """Tokens the episode's next turn may take."""
    if run.budget is None:
        return run.sampling.max_new_tokens
    return min(run.sampling.max_new_tokens, run.budget - len(episode))


def _budget_groups(run: EpisodeRun, episodes: list[EpisodeState], active: list[int]) -> list[list[int]]:
    """The active episodes by the tokens their next turn may take, one engine call each: no call then asks for more
    than any of its episodes has room for (most have the whole ``max_new_tokens``, so most turns are one call).
    Sharded sampling is a collective with a fixed number of calls: one call, each episode cut to its room."""
    if run.synced_gpus:
        return [active]
    groups: dict[int, list[int]] = {}
    for index in active:
        groups.setdefault(_remaining(run, episodes[index]), []).append(index)
    return [groups[budget] for budget in sorted(groups, reverse=True)] or [[]]


def _sample_turn(run: EpisodeRun, active: list[EpisodeState], seed: int) -> EngineSamples:
    """One engine call for every active episode: its whole history, one continuation each."""
    budget = max((_remaining(run, e) for e in active), default=1)
    settings = SamplingSettings(budget, run.sampling.temperature, run.sampling.top_p, run.sampling.top_k)
    contexts = [e.prompt_ids + e.response_ids for e in active]
    return continue_token_lists(run.engine, run.policy, run.tokenizer, contexts, settings, seed, run.with_logprobs,
                                run.synced_gpus, run.device)  # fmt: skip


def _take_turn(run: EpisodeRun, episode: EpisodeState, samples: EngineSamples, row: int) -> None:
    """Append the sampled turn (up to and including EOS, within the episode's budget) as policy tokens."""
    eos = run.tokenizer.eos_token_id
    room = _remaining(run, episode)
    tokens = new_tokens(samples.response_ids[row].tolist(), eos, room)
    logprobs = samples.logprobs[row, : len(tokens)].tolist() if samples.logprobs is not None else None
    episode.append(tokens, policy=True, logprobs=logprobs)
    ended = bool(tokens) and tokens[-1] == eos
    text = run.tokenizer.decode(tokens, skip_special_tokens=True)
    episode.messages.append({"role": "assistant", "content": text})
    episode.final_answer = text
    if not ended:  # cut: by the turn's budget, or by what was left of the episode's
        episode.turn_rewards.append(0.0)
        episode.stop("context" if room < run.sampling.max_new_tokens else "turn_tokens")


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

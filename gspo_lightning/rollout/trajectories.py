"""Finished trajectories (``episodes/loop.py``: multi-turn episodes, or single responses as one-turn ones) as
training data: their rewards (one scoring call), then a ``Rollout`` whose response is everything after the first
context and whose ``response_mask`` marks the policy's own tokens. Nothing after this stage knows about turns:
every objective, KL term, correction and diagnostic reads the mask."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from gspo_lightning.engines.base import SamplingEngine, SamplingSettings, padded
from gspo_lightning.episodes.loop import EpisodeRun, EpisodeState, advance, run_episodes
from gspo_lightning.episodes.rewards import ENVIRONMENT_REWARD, EPISODE_MESSAGES
from gspo_lightning.episodes.settings import EpisodeSettings
from gspo_lightning.moe.rollout_routes import rollout_routes
from gspo_lightning.rewards.scoring import score_completions
from gspo_lightning.rollout.pipeline import PromptOverflow, Scoring, context_length, encode_prompts
from gspo_lightning.rollout.pipeline import fit_prompts_to_context, repeat_each
from gspo_lightning.rollout.types import EpisodeCounts, Rollout


def trajectory_run(
    engine: SamplingEngine, policy: nn.Module, tokenizer: PreTrainedTokenizerBase, sampling: SamplingSettings,
    episodes: EpisodeSettings | None, errors: str = "raise", with_logprobs: bool = False, synced_gpus: bool = False,
    device: Any = "cpu", with_routes: bool = False,
) -> EpisodeRun:  # fmt: skip
    """What the trajectory generator runs with: a turn is sampled with ``sampling`` (its ``max_new_tokens`` per
    turn), an episode holds at most ``max_episode_tokens`` (the policy's context when unset); ``episodes`` None:
    single responses (one turn, no environment, no episode budget). ``with_routes``: the engine records each
    token's experts (R3)."""
    factory, turns, budget = None, 1, None
    if episodes is not None:
        factory, turns = episodes.factory(), episodes.max_turns
        budget = episodes.episode_budget(context_length(policy, tokenizer))
    return EpisodeRun(engine, policy, tokenizer, sampling, factory, turns, budget, errors, with_logprobs, synced_gpus,
                      device, with_routes)  # fmt: skip


def single_responses(prompt_ids: Tensor, prompt_mask: Tensor, cut: Tensor, group_size: int) -> list[EpisodeState]:
    """``group_size`` one-turn trajectories per left-padded prompt [P, Lp] (mask [P, Lp], ``cut`` [P] bool: the
    prompt was cut to fit the context), prompt i's at i*G .. i*G + G - 1."""
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]
    return [
        EpisodeState(None, [], list(ids), prompt_cut=bool(was_cut))
        for ids, was_cut in zip(rows, cut.tolist())
        for _ in range(group_size)
    ]


def score_episodes(
    episodes: list[EpisodeState], prompts: list[Any], columns: dict[str, list[Any]], group_size: int, scoring: Scoring,
    single: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
    """Each trajectory's reward [N] from the reward functions, applied to its final answer (``completions``); an
    episode's messages (``episode_messages``) and environment reward (``environment_reward``) are among the columns
    (not a ``single`` response's); NaN for an episode whose environment or tool failed (``reward_errors: skip``)."""
    row_columns = {name: repeat_each(values, group_size) for name, values in columns.items()}
    if not single:
        row_columns[ENVIRONMENT_REWARD] = [sum(e.turn_rewards) for e in episodes]
        row_columns[EPISODE_MESSAGES] = [e.messages for e in episodes]
    rewards, components = score_completions(
        scoring.rewards, scoring.weights, repeat_each(prompts, group_size), [e.final_answer for e in episodes],
        row_columns, runner=scoring.runner, errors=scoring.errors, settings=scoring.settings,
    )  # fmt: skip
    failed = torch.tensor([e.failure is not None for e in episodes])  # [N]
    return torch.where(failed, torch.full_like(rewards, float("nan")), rewards), components  # [N]


@dataclass(frozen=True)
class RolloutLayout:
    """What a trajectory rollout holds beyond the tokens: ``single`` responses (no turns, texts as answers),
    engine log-probs, policy versions (sampled by more than one), skipped cut prompts (``prompt_overflow: skip``),
    the engine's routed experts (R3)."""

    single: bool = False
    with_logprobs: bool = False
    with_versions: bool = False
    skip_cut: bool = False
    with_routes: bool = False


def episode_rollout(
    episodes: list[EpisodeState], prompts: list[Any], rewards: Tensor, components: dict[str, Tensor], group_size: int,
    tokenizer: PreTrainedTokenizerBase, max_turns: int, layout: RolloutLayout, device: Any,
) -> Rollout:  # fmt: skip
    """The N trajectories as one ``Rollout`` (advantages still None) on ``device``."""
    pad = tokenizer.pad_token_id
    response_ids = padded([e.response_ids for e in episodes], pad, torch.long).to(device)  # [N, R]
    attention = padded([[1] * len(e.response_ids) for e in episodes], 0, torch.long).to(device)  # [N, R]
    policy_mask = padded([e.policy_mask for e in episodes], 0, torch.long).to(device)  # [N, R]
    prompt_ids = padded([e.prompt_ids for e in episodes], pad, torch.long, left=True).to(device)  # [N, Lp]
    prompt_mask = padded([[1] * len(e.prompt_ids) for e in episodes], 0, torch.long, left=True).to(device)
    cut = torch.tensor([e.prompt_cut for e in episodes], device=device)  # [N]
    engine = padded([e.logprobs for e in episodes], 0.0, torch.float32).to(device) if layout.with_logprobs else None
    versions = padded([e.versions for e in episodes], -1, torch.long).to(device) if layout.with_versions else None
    turns = None if layout.single else padded([e.turn_of for e in episodes], -1, torch.long).to(device)  # [N, R]
    routes = None
    if layout.with_routes:  # [N, layers, Lp + R, k]
        routes = rollout_routes([e.routes for e in episodes], [len(e.prompt_ids) for e in episodes],
                                prompt_ids.shape[1], response_ids.shape[1]).to(device)  # fmt: skip
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,  # [N, Lp]
        response_ids=response_ids,
        response_mask=policy_mask,
        rewards=rewards.to(device),  # [N]
        advantages=None,
        truncated=torch.tensor([e.truncated_by is not None for e in episodes], device=device),  # [N]
        completions=[e.final_answer if layout.single else tokenizer.decode(e.response_ids, skip_special_tokens=False)
                     for e in episodes],  # fmt: skip
        prompts=repeat_each(prompts, group_size),
        reward_components=components,
        prompt_cut=cut,
        prompt_skipped=cut if layout.skip_cut else None,  # [N] or None
        engine_logprobs=engine,  # [N, R] or None
        response_attention=None if layout.single else attention,  # [N, R]: the mask is the attention
        turn_index=turns,
        turn_rewards=None if layout.single else turn_rewards(episodes, rewards, max_turns).to(device),  # [N, K]
        episodes=None if layout.single else episode_counts(episodes),
        policy_versions=versions,  # [N, R] or None
        routes=routes,  # [N, layers, Lp + R, k] or None
    )


def turn_rewards(episodes: list[EpisodeState], rewards: Tensor, max_turns: int) -> Tensor:
    """[N, K] each turn's reward: the environment's for every turn but the last, and the rest of the episode's
    reward at its last turn, so that a row sums to the episode's reward (NaN rows stay NaN)."""
    table = torch.zeros(len(episodes), max(max_turns, 1), dtype=torch.float32)  # [N, K]
    for row, episode in enumerate(episodes):
        last = max(episode.turns, 1) - 1
        earlier = episode.turn_rewards[:last]
        table[row, :last] = torch.tensor(earlier, dtype=torch.float32)
        table[row, last] = float(rewards[row]) - sum(earlier)
    return table


def episode_counts(episodes: list[EpisodeState]) -> EpisodeCounts:
    """Per-episode figures for the metrics."""

    def column(values: list[Any], dtype: torch.dtype = torch.long) -> Tensor:
        return torch.tensor(values, dtype=dtype)

    policy = [sum(e.policy_mask) for e in episodes]
    return EpisodeCounts(
        turns=column([e.turns for e in episodes]),
        tool_calls=column([e.tool_calls for e in episodes]),
        tool_errors=column([e.tool_errors for e in episodes]),
        policy_tokens=column(policy),
        context_tokens=column([len(e.response_ids) - p for e, p in zip(episodes, policy)]),
        truncated_turns=column([e.truncated_by == "turns" for e in episodes], torch.bool),
        truncated_turn_tokens=column([e.truncated_by == "turn_tokens" for e in episodes], torch.bool),
        truncated_context=column([e.truncated_by == "context" for e in episodes], torch.bool),
        failed=column([e.failure is not None for e in episodes], torch.bool),
    )


def sample_and_score_trajectories(
    run: EpisodeRun, prompts: list[Any], columns: dict[str, list[Any]], group_size: int, scoring: Scoring, seed: int,
    overflow: PromptOverflow = "error", overflow_setting: str = "sampler.prompt_overflow",
    any_rank: Callable[[bool], bool] = bool,
) -> tuple[Rollout, dict[str, float]]:  # fmt: skip
    """The sampling stage of a round (and of the evaluation): ``group_size`` trajectories per prompt (single
    responses, or episodes when ``run`` has an environment), scored, as a ``Rollout``; and the seconds it took
    (``generate_s``: tools and environments included; ``reward_s``)."""
    started = time.perf_counter()
    single = run.make_environment is None
    if single:
        context = context_length(run.policy, run.tokenizer)
        states = fitted_responses(run, prompts, group_size, context, overflow, overflow_setting)
        advance(run, states, list(range(len(states))), seed, group_size=group_size)
    else:
        states = run_episodes(run, prompts, columns, group_size, seed, any_rank)
    generate_s = time.perf_counter() - started
    started = time.perf_counter()
    rewards, components = score_episodes(states, prompts, columns, group_size, scoring, single)  # [N]
    seconds = {"generate_s": generate_s, "reward_s": time.perf_counter() - started}
    skip_cut = single and overflow == "skip"
    layout = RolloutLayout(single, run.with_logprobs, skip_cut=skip_cut, with_routes=run.with_routes)
    rollout = episode_rollout(
        states, prompts, rewards, components, group_size, run.tokenizer, run.max_turns, layout, run.device
    )
    return rollout, seconds


def fitted_responses(
    run: EpisodeRun, prompts: list[Any], group_size: int, context: int | None, overflow: PromptOverflow = "error",
    setting: str = "sampler.prompt_overflow",
) -> list[EpisodeState]:  # fmt: skip
    """``group_size`` single responses per prompt, not yet started: the prompts tokenised and fitted to the
    ``context`` (the policy's) with ``max_new_tokens`` of room (``overflow``: see ``fit_prompts_to_context``)."""
    ids, mask = encode_prompts(run.tokenizer, prompts, run.device)  # [P, Lp] x2
    ids, mask, cut = fit_prompts_to_context(
        ids, mask, run.sampling.max_new_tokens, context, overflow, setting
    )  # [P, Lp'] x2, [P]
    return single_responses(ids, mask, cut, group_size)

"""Finished episodes as training data: their rewards, then a ``Rollout`` whose response is everything after the
first context and whose ``response_mask`` marks the policy's own tokens. Nothing after this stage knows about
turns: every objective, KL term, correction and diagnostic reads the mask."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch import nn
from transformers import PreTrainedTokenizerBase

from gspo_lightning.engines.base import SamplingEngine, SamplingSettings, padded
from gspo_lightning.episodes.loop import EpisodeRun, EpisodeState, run_episodes
from gspo_lightning.episodes.settings import EpisodeSettings
from gspo_lightning.episodes.rewards import ENVIRONMENT_REWARD, EPISODE_MESSAGES
from gspo_lightning.rewards.scoring import score_completions
from gspo_lightning.rollout.pipeline import Scoring, context_length, repeat_each
from gspo_lightning.rollout.types import EpisodeCounts, Rollout

def episode_run(
    engine: SamplingEngine,
    policy: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    sampling: SamplingSettings,
    episodes: EpisodeSettings,
    errors: str = "raise",
    with_logprobs: bool = False,
    synced_gpus: bool = False,
    device: Any = "cpu",
) -> EpisodeRun:
    """What the episode loop runs with: a turn is sampled with ``sampling`` (its ``max_new_tokens`` per turn), an
    episode holds at most ``max_episode_tokens`` (the policy's context when unset)."""
    return EpisodeRun(
        engine=engine,
        policy=policy,
        tokenizer=tokenizer,
        sampling=sampling,
        make_environment=episodes.factory(),
        max_turns=episodes.max_turns,
        budget=episodes.episode_budget(context_length(policy, tokenizer)),
        errors=errors,
        with_logprobs=with_logprobs,
        synced_gpus=synced_gpus,
        device=device,
    )


def score_episodes(
    episodes: list[EpisodeState], prompts: list[Any], columns: dict[str, list[Any]], group_size: int, scoring: Scoring
) -> tuple[Tensor, dict[str, Tensor]]:
    """Each episode's reward [N] from the reward functions, applied to its final answer (``completions``), with
    its messages (``episode_messages``) and environment reward (``environment_reward``) among the columns; NaN
    for an episode whose environment or tool failed (``reward_errors: skip``)."""
    row_columns = {name: repeat_each(values, group_size) for name, values in columns.items()}
    row_columns[ENVIRONMENT_REWARD] = [sum(e.turn_rewards) for e in episodes]
    row_columns[EPISODE_MESSAGES] = [e.messages for e in episodes]
    rewards, components = score_completions(
        scoring.rewards, scoring.weights, repeat_each(prompts, group_size), [e.final_answer for e in episodes],
        row_columns, runner=scoring.runner, errors=scoring.errors, settings=scoring.settings,
    )  # fmt: skip
    failed = torch.tensor([e.failure is not None for e in episodes])  # [N]
    return torch.where(failed, torch.full_like(rewards, float("nan")), rewards), components  # [N]


def episode_rollout(
    episodes: list[EpisodeState],
    prompts: list[Any],
    rewards: Tensor,
    components: dict[str, Tensor],
    group_size: int,
    tokenizer: PreTrainedTokenizerBase,
    max_turns: int,
    with_logprobs: bool,
    device: Any,
) -> Rollout:
    """The N episodes as one ``Rollout`` (advantages still None) on ``device``."""
    pad = tokenizer.pad_token_id
    response_ids = padded([e.response_ids for e in episodes], pad, torch.long).to(device)  # [N, R]
    attention = padded([[1] * len(e.response_ids) for e in episodes], 0, torch.long).to(device)  # [N, R]
    policy_mask = padded([e.policy_mask for e in episodes], 0, torch.long).to(device)  # [N, R]
    prompt_ids = padded([e.prompt_ids for e in episodes], pad, torch.long, left=True).to(device)  # [N, Lp]
    prompt_mask = padded([[1] * len(e.prompt_ids) for e in episodes], 0, torch.long, left=True).to(device)
    engine = padded([e.logprobs for e in episodes], 0.0, torch.float32).to(device) if with_logprobs else None
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,  # [N, Lp]
        response_ids=response_ids,
        response_mask=policy_mask,
        rewards=rewards.to(device),  # [N]
        advantages=None,
        truncated=torch.tensor([e.truncated_by is not None for e in episodes], device=device),  # [N]
        completions=[tokenizer.decode(e.response_ids, skip_special_tokens=False) for e in episodes],
        prompts=repeat_each(prompts, group_size),
        reward_components=components,
        engine_logprobs=engine,  # [N, R] or None
        response_attention=attention,  # [N, R]
        turn_index=padded([e.turn_of for e in episodes], -1, torch.long).to(device),  # [N, R]
        turn_rewards=turn_rewards(episodes, rewards, max_turns).to(device),  # [N, K]
        episodes=episode_counts(episodes),
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


def sample_and_score_episodes(
    run: EpisodeRun,
    prompts: list[Any],
    columns: dict[str, list[Any]],
    group_size: int,
    scoring: Scoring,
    seed: int,
    any_rank: Callable[[bool], bool] = bool,
) -> tuple[Rollout, dict[str, float]]:
    """The episode stage of a round: ``group_size`` episodes per prompt, scored, as a ``Rollout``; and the
    seconds it took (``generate_s``: the episodes, tools and environments included; ``reward_s``)."""
    started = time.perf_counter()
    episodes = run_episodes(run, prompts, columns, group_size, seed, any_rank)
    generate_s = time.perf_counter() - started
    started = time.perf_counter()
    rewards, components = score_episodes(episodes, prompts, columns, group_size, scoring)  # [N]
    seconds = {"generate_s": generate_s, "reward_s": time.perf_counter() - started}
    rollout = episode_rollout(
        episodes, prompts, rewards, components, group_size, run.tokenizer, run.max_turns, run.with_logprobs,
        run.device,
    )  # fmt: skip
    return rollout, seconds

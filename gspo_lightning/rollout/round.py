"""One rollout round as plain functions over typed data, in the order it runs:

    sample (engine) -> score -> refill (dynamic sampling) -> pi_old / reference / routes pass
    -> reward shaping (KL in the reward) -> advantages (Eq. 6), once -> K minibatches

No Lightning here: the engine, the model's parts (``RoundModel``), the settings, the seed and the means to draw
more prompts are handed in. ``GroupSampler`` (``sampling/sampler.py``) is the Lightning plumbing around it: when a
round starts, the weight sync and the inference context, state for resume, logging.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from gspo_lightning.engines.base import SamplingEngine, SamplingSettings
from gspo_lightning.logprobs import DEFAULT_CHUNK_SIZE
from gspo_lightning.micro_batches import BatchLayout
from gspo_lightning.objectives import AdvantageScale, KLRewardPenalty
from gspo_lightning.episodes.loop import EpisodeRun
from gspo_lightning.episodes.settings import EpisodeSettings
from gspo_lightning.objectives.advantages import advantages_with_skips, skipped_responses, turn_advantages
from gspo_lightning.objectives.kl import kl_penalised_rewards
from gspo_lightning.rollout.dynamic_sampling import choose_groups, concat_rollouts, informative_groups, select_groups
from gspo_lightning.rollout.minibatches import PolicyPass, assemble_minibatches, policy_passes
from gspo_lightning.rollout.trajectories import sample_and_score_trajectories, trajectory_run
from gspo_lightning.rollout.pipeline import PromptOverflow, Scoring
from gspo_lightning.rollout.types import Minibatch, Prompt, PromptBatch, Rollout


@dataclass(frozen=True)
class RoundSettings:
    """The sampler's settings a round runs with (see ``GroupSampler`` for each one's meaning)."""

    group_size: int
    num_minibatches: int
    scoring: Scoring
    top_p: float = 1.0  # 1.0 and 0 for training: the ratios describe softmax(logits / T) untruncated
    top_k: int = 0
    advantage_scale: AdvantageScale = "group"
    old_from_engine: bool = False  # sampler.old_logprobs: engine
    prompt_overflow: PromptOverflow = "error"
    dynamic_sampling: bool = False
    max_extra_draws: int = 4
    mask_truncated: bool = False
    episodes: EpisodeSettings | None = None  # multi-turn episodes instead of single responses


@dataclass(frozen=True)
class RoundModel:
    """What a round uses of the trained model, taken from the LightningModule (``rollout/contract.py``)."""

    policy: nn.Module
    tokenizer: PreTrainedTokenizerBase
    temperature: float = 1.0  # of the samples and of every log-prob taken of them
    max_new_tokens: int = 256
    device: torch.device | str = "cpu"
    reference: nn.Module | None = None  # pi_ref, for a KL penalty
    kl_reward_penalty: KLRewardPenalty | None = None  # kl_in: reward
    chunk_size: int = DEFAULT_CHUNK_SIZE
    layout: BatchLayout = BatchLayout()  # how log-prob passes lay out a minibatch (packed, token budget)
    engine_logprobs: bool = False  # ask the engine for its log-probs of the sampled tokens
    synced_gpus: bool = False  # sharded parameters: every rank steps until all have finished
    engine_routes: bool = False  # ask the engine for each token's experts (an MoE policy, an engine that can)
    routing_replay: str = "off"  # model.routing_replay: off, old (R2) or rollout (R3: the engine's experts)


@dataclass
class RoundResult:
    """A finished round.

    Attributes:
        rollout: the N = P x G responses as trained on (final advantages; ``kl_penalties`` when shaped).
        minibatches: the K ``Minibatch``es, in training order.
        counts: dynamic sampling's ``groups_drawn``, ``groups_dropped``, ``groups_kept``, ``extra_draws`` (or {}).
        seconds: ``generate_s``, ``reward_s`` (the last sampling's) and ``old_logprob_s``.
    """

    rollout: Rollout
    minibatches: list[Minibatch]
    counts: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


def run_round(
    engine: SamplingEngine, model: RoundModel, settings: RoundSettings, batch: PromptBatch, seed: int,
    draw_prompts: Callable[[], PromptBatch] | None = None, any_rank: Callable[[bool], bool] = bool,
) -> RoundResult:  # fmt: skip
    """One round, every stage once. ``draw_prompts`` serves dynamic sampling's extra prompts; ``any_rank`` turns
    this rank's "I need more" into the decision of all ranks (sharded sampling is a collective)."""
    seconds: dict[str, float] = {}
    rollout, counts = sample_round(engine, model, settings, batch, seed, seconds, draw_prompts, any_rank)
    engine.after_rollout()
    return train_round(rollout, model, settings, counts, seconds)


def sample_round(
    engine: SamplingEngine, model: RoundModel, settings: RoundSettings, batch: PromptBatch, seed: int,
    seconds: dict[str, float], draw_prompts: Callable[[], PromptBatch] | None = None,
    any_rank: Callable[[bool], bool] = bool,
) -> tuple[Rollout, dict[str, int]]:  # fmt: skip
    """The round's first stages: sample, score and (dynamic sampling) refill; the scored rollout (advantages
    None) and dynamic sampling's counts. Asynchronous rollouts run this ahead of training."""
    rollout = sample_groups(engine, model, settings, batch.prompts, batch.columns, seed, seconds, any_rank)
    counts: dict[str, int] = {}
    if settings.dynamic_sampling:
        if draw_prompts is None:
            raise ValueError("dynamic sampling needs draw_prompts (PromptDataModule.draw_prompts)")

        def sample_more(extra: int) -> Rollout:
            more = draw_prompts()
            return sample_groups(engine, model, settings, more.prompts, more.columns, seed + extra, seconds, any_rank)

        rollout, counts = refill_groups(rollout, sample_more, settings, model.tokenizer.pad_token_id, any_rank)
    return rollout, counts


def train_round(
    rollout: Rollout, model: RoundModel, settings: RoundSettings, counts: dict[str, int] | None = None,
    seconds: dict[str, float] | None = None,
) -> RoundResult:  # fmt: skip
    """The round's last stages, with the trainer's current weights: pi_old's (and the reference's) pass, reward
    shaping, advantages (once) and the K minibatches. Under asynchronous rollouts this pi_old is the proximal
    policy and ``rollout.engine_logprobs`` the behaviour policy's."""
    seconds = dict(seconds or {})
    started = time.perf_counter()
    passes = policy_passes(
        rollout, settings.num_minibatches, model.policy, model.temperature, reference=model.reference,
        chunk_size=model.chunk_size, layout=model.layout, old_from_engine=settings.old_from_engine,
        mask_truncated=settings.mask_truncated, routing_replay=model.routing_replay,
    )  # fmt: skip
    seconds["old_logprob_s"] = time.perf_counter() - started
    rewards = rollout.rewards  # [N]
    if model.kl_reward_penalty is not None:
        rewards, kl = shaped_rewards(rollout, passes, model.kl_reward_penalty)  # [N] x2
        rollout = replace(rollout, kl_penalties=kl)
    rollout = with_advantages(rollout, rewards, settings)
    return RoundResult(rollout, assemble_minibatches(passes, rollout), dict(counts or {}), seconds)


def sample_groups(
    engine: SamplingEngine, model: RoundModel, settings: RoundSettings, prompts: list[Prompt],
    columns: dict[str, list[Any]], seed: int, seconds: dict[str, float] | None = None,
    any_rank: Callable[[bool], bool] = bool,
) -> Rollout:  # fmt: skip
    """G responses (or, with ``settings.episodes``, G multi-turn episodes) per prompt from the engine, scored
    (``advantages`` still None); ``seconds`` gets the timings. ``any_rank``: as in ``run_round`` (episodes under
    sharded parameters take a turn as long as any rank has an episode going)."""
    rollout, timing = sample_and_score_trajectories(
        round_trajectory_run(engine, model, settings), prompts, columns, settings.group_size, settings.scoring, seed,
        settings.prompt_overflow, any_rank=any_rank if model.synced_gpus else bool,
    )  # fmt: skip
    if seconds is not None:
        seconds.update(timing)
    return rollout


def refill_groups(
    rollout: Rollout, sample_more: Callable[[int], Rollout], settings: RoundSettings, pad_token_id: int,
    any_rank: Callable[[bool], bool] = bool,
) -> tuple[Rollout, dict[str, int]]:  # fmt: skip
    """DAPO's dynamic sampling: more prompts (``sample_more(k)`` for the k-th extra batch) until P informative
    groups or ``max_extra_draws``, then the round's P groups: the informative ones first."""
    group = settings.group_size
    prompts = len(rollout) // group
    parts, extra = [rollout], 0
    informative = int(informative_groups(rollout.rewards, group).sum())
    while extra < settings.max_extra_draws and any_rank(informative < prompts):
        extra += 1
        sampled = sample_more(extra)
        parts.append(sampled)
        informative += int(informative_groups(sampled.rewards, group).sum())
    every = concat_rollouts(parts, pad_token_id)
    flags = informative_groups(every.rewards, group)  # [P_drawn]
    counts = {"groups_drawn": len(flags), "groups_dropped": int((~flags).sum()),
              "groups_kept": min(int(flags.sum()), prompts), "extra_draws": extra}  # fmt: skip
    return select_groups(every, choose_groups(flags, prompts), group), counts


def shaped_rewards(rollout: Rollout, passes: list[PolicyPass], penalty: KLRewardPenalty) -> tuple[Tensor, Tensor]:
    """``kl_in="reward"``: each response's reward minus beta * its KL(pi_old || pi_ref) estimate, and the
    estimates; [N] float32 each."""
    if any(part.ref_logprobs is None for part in passes):
        raise ValueError("a KL reward penalty needs the LightningModule's reference_policy (kl_coef > 0)")
    shaped, estimates, start = [], [], 0
    for part in passes:
        rows = slice(start, start + len(part))
        start += len(part)
        reward, kl = kl_penalised_rewards(
            rollout.rewards[rows], part.old_logprobs, part.ref_logprobs, part.response_mask, penalty
        )  # [n] x2
        shaped.append(reward)
        estimates.append(kl)
    return torch.cat(shaped), torch.cat(estimates)  # [N] x2


def round_trajectory_run(engine: SamplingEngine, model: RoundModel, settings: RoundSettings) -> EpisodeRun:
    """The trajectory generator's settings in a training round: a turn is sampled like a response."""
    sampling = SamplingSettings(model.max_new_tokens, model.temperature, settings.top_p, settings.top_k)
    return trajectory_run(engine, model.policy, model.tokenizer, sampling, settings.episodes, settings.scoring.errors,
                          model.engine_logprobs, model.synced_gpus, model.device, model.engine_routes)  # fmt: skip


def with_advantages(rollout: Rollout, rewards: Tensor, settings: RoundSettings) -> Rollout:
    """The rollout with its advantages (Eq. 6) of ``rewards`` [N] and, for per-turn advantages of episodes, its
    token advantages [N, R]."""
    rollout = replace(rollout, advantages=round_advantages(rollout, rewards, settings))
    if settings.episodes is None or not settings.episodes.turn_advantages:
        return rollout
    assert rollout.turn_rewards is not None and rollout.turn_index is not None and rollout.episodes is not None
    # A reward shaped after sampling (KL in the reward) changes the episode's total: the change is its last turn's.
    last = (rollout.episodes.turns.clamp(min=1) - 1).to(rollout.turn_rewards.device)  # [N]
    shift = (rewards - rollout.rewards).to(rollout.turn_rewards.device)  # [N]
    turn_rewards = rollout.turn_rewards.scatter_add(1, last[:, None], shift[:, None])  # [N, K]
    skipped = skipped_responses(rollout.rewards, rollout.prompt_skipped, settings.group_size)  # [N]
    token = turn_advantages(turn_rewards, rollout.turn_index, skipped.to(turn_rewards.device), settings.group_size,
                            settings.advantage_scale)  # [N, R]  # fmt: skip
    return replace(rollout, token_advantages=token)


def round_advantages(rollout: Rollout, rewards: Tensor, settings: RoundSettings) -> Tensor:
    """Group advantages (Eq. 6) of ``rewards`` [N], exactly 0 for every group with a failed reward or a skipped
    prompt; [N] float32 on the rollout's device."""
    skipped = skipped_responses(rollout.rewards, rollout.prompt_skipped, settings.group_size)  # [N]
    skipped = skipped.to(rewards.device)
    advantages = advantages_with_skips(rewards, skipped, settings.group_size, settings.advantage_scale)  # [N]
    return advantages.to(rollout.rewards.device)  # [N]

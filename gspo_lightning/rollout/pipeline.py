"""One sampling pipeline for training rollouts and the held-out evaluation alike:

    prompts -> tokens fitted to the context -> the engine's samples -> response masks and texts -> rewards

``GroupSampler`` turns the result into advantages and minibatches; ``HeldOutEvaluation`` counts what was solved.
No Lightning here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from gspo_lightning.engines.base import EngineSamples, SamplingEngine
from gspo_lightning.rewards.isolation import RewardRunner
from gspo_lightning.rewards.scoring import RewardFunction, score_completions
from gspo_lightning.rollout.generation import (
    SamplingSettings,
    decode_responses,
    encode_prompts,
    response_mask_until_eos,
)
from gspo_lightning.rollout.prompts import PromptOverflow, context_length, fit_prompts_to_context
from gspo_lightning.rollout.types import Prompt


@dataclass
class ScoredSamples:
    """P prompts, ``group_size`` samples each (N = P * G, prompt i's at rows i*G .. i*G + G - 1), scored.

    Shapes:
        prompt_ids:    [P, Lp] left-padded prompt tokens, fitted to the context (each prompt once)
        prompt_mask:   [P, Lp]
        prompt_cut:    [P] bool, True where the prompt was cut to fit the context
        samples:       the engine's ``EngineSamples`` (response_ids [N, R], logprobs [N, R] or None, ...)
        response_mask: [N, R] 1 up to and including the first EOS
        truncated:     [N] bool, True where the response hit max_new_tokens without EOS
        completions:   N response texts (EOS and what follows left out)
        rewards:       [N] weighted reward (NaN where unavailable under ``reward_errors="skip"``)
        reward_components: each reward function's [N] scores, by name
        seconds:       ``generate_s`` and ``reward_s``
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    prompt_cut: Tensor
    samples: EngineSamples
    response_mask: Tensor
    truncated: Tensor
    completions: list[str]
    rewards: Tensor
    reward_components: dict[str, Tensor] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Scoring:
    """How completions are scored: the reward functions, their weights, how they run and what a failure does."""

    rewards: Sequence[RewardFunction]
    weights: Sequence[float]
    runner: RewardRunner | None = None
    errors: str = "raise"


def sample_and_score(
    engine: SamplingEngine,
    policy: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[Prompt],
    columns: dict[str, list[Any]],
    settings: SamplingSettings,
    group_size: int,
    scoring: Scoring,
    device: Any = "cpu",
    overflow: PromptOverflow = "error",
    overflow_setting: str = "sampler.prompt_overflow",
    with_logprobs: bool = False,
    synced_gpus: bool = False,
    seed: int = 0,
) -> ScoredSamples:
    """Sample ``group_size`` responses per prompt with ``engine`` and score each with ``scoring``; the prompts are
    tokenised onto ``device`` (the module's)."""
    started = time.perf_counter()
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts, device)  # [P, Lp] x2
    prompt_ids, prompt_mask, cut = fit_prompts_to_context(
        prompt_ids, prompt_mask, settings.max_new_tokens, context_length(policy, tokenizer), overflow,
        setting=overflow_setting,
    )  # [P, Lp'] x2, [P]  # fmt: skip
    samples = engine.sample(
        policy, tokenizer, prompt_ids, prompt_mask, settings, group_size, with_logprobs, synced_gpus, seed
    )
    response_mask, truncated = response_mask_until_eos(samples.response_ids, tokenizer.eos_token_id)  # [N, R], [N]
    completions = decode_responses(tokenizer, samples.response_ids, response_mask)
    generate_s = time.perf_counter() - started

    started = time.perf_counter()
    rewards, components = score_completions(
        scoring.rewards,
        scoring.weights,
        repeat_each(prompts, group_size),
        completions,
        {name: repeat_each(values, group_size) for name, values in columns.items()},
        runner=scoring.runner,
        errors=scoring.errors,
    )  # [N], NaN where a reward is unavailable
    seconds = {"generate_s": generate_s, "reward_s": time.perf_counter() - started}
    return ScoredSamples(
        prompt_ids, prompt_mask, cut, samples, response_mask, truncated, completions, rewards, components, seconds
    )


def repeat_each(values: list[Any], times: int) -> list[Any]:
    """Each value ``times`` times in a row, matching ``repeat_interleave`` of the prompt rows."""
    return [value for value in values for _ in range(times)]

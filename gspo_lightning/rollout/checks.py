"""Early checks of the GroupSampler's and the HeldOutEvaluation's settings and of what the trainer hands them,
before any model is built; each message names the setting as the user wrote it."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn

from gspo_lightning.engines.base import RoundNeed, SamplingEngine
from gspo_lightning.rollout.data_contract import DataSide
from gspo_lightning.rewards.columns import check_reward_columns
from gspo_lightning.objectives import ADVANTAGE_SCALES
from gspo_lightning.rewards.isolation import REWARD_ISOLATIONS
from gspo_lightning.rewards.scoring import REWARD_ERRORS
from gspo_lightning.rollout.minibatches import check_divisible
from gspo_lightning.rollout.pipeline import PROMPT_OVERFLOWS, encode_prompts
from gspo_lightning.validation import SettingError, require, require_one_of


def validate_sampling(
    rewards: Sequence[Any], reward_weights: Sequence[float] | None, group_size: int, num_minibatches: int,
    top_p: float, top_k: int,
) -> None:  # fmt: skip
    """Rewards, group size, K and the sampler's untruncated sampling."""
    require(len(rewards) > 0, "sampler.rewards must name at least one reward function")
    require(
        reward_weights is None or len(reward_weights) == len(rewards),
        f"sampler.reward_weights has {len(reward_weights or [])} values for {len(rewards)} rewards",
    )
    require(group_size >= 2, f"sampler.group_size must be >= 2 (advantages compare a group), got {group_size}")
    require(num_minibatches >= 1, f"sampler.num_minibatches must be >= 1, got {num_minibatches}")
    # pi_old and pi_theta are softmax(logits / temperature) over the whole vocabulary (logprobs.py): samples
    # from a truncated distribution would not come from the policy the ratios describe (a biased gradient).
    untruncated = "the log-probs of pi_old and pi_theta are those of softmax(logits / temperature) over the whole "
    untruncated += "vocabulary, so truncated sampling would bias the gradient (evaluation.top_p/top_k may truncate)"
    require(top_p == 1, f"sampler.top_p must be 1.0 (no nucleus truncation), got {top_p}: {untruncated}")
    require(top_k == 0, f"sampler.top_k must be 0 (no top-k truncation), got {top_k}: {untruncated}")


def validate_round(advantage_scale: str, max_extra_draws: int) -> None:
    """What the advantages are divided by, and dynamic sampling's cap on extra draws."""
    require_one_of("sampler.advantage_scale", advantage_scale, ADVANTAGE_SCALES)
    require(
        isinstance(max_extra_draws, int) and max_extra_draws >= 0,
        f"sampler.max_extra_draws must be an integer >= 0, got {max_extra_draws!r}",
    )


def check_routing_replay(routing_replay: str, old_logprobs: str, engine: SamplingEngine, device: torch.device,
                         set_up: bool = False) -> None:  # fmt: skip
    """R2 replays the experts pi_old's forward recorded (the sampler's own log-probs come without one); R3 needs an
    engine that records the experts it sampled with for a trainer on ``device``: asked before the engine is built,
    and once it is (``set_up``: whether it does, e.g. servers given by URL found to report none)."""
    require(
        routing_replay != "old" or old_logprobs == "recompute",
        f"model.routing_replay: old needs sampler.old_logprobs: recompute (the experts to replay are recorded by "
        f"the old-policy forward), got sampler.old_logprobs: {old_logprobs!r}; model.routing_replay: rollout "
        "replays the sampling engine's experts instead",
    )
    if routing_replay != "rollout":
        return
    refusal = engine.routes_refusal(device)
    if refusal is None and set_up and not engine.records_routes:
        refusal = "it was set up without them"
    require(
        refusal is None,
        f"model.routing_replay: rollout needs a sampling engine that records each token's experts; sampler.engine: "
        f"{engine.name} does not: {refusal}",
    )


def validate_robustness(
    reward_timeout_s: float | None, reward_isolation: str, reward_errors: str, prompt_overflow: str
) -> None:
    """How misbehaving reward functions and overlong prompts are handled."""
    require_one_of("sampler.reward_isolation", reward_isolation, REWARD_ISOLATIONS)
    require_one_of("sampler.reward_errors", reward_errors, REWARD_ERRORS)
    require_one_of("sampler.prompt_overflow", prompt_overflow, PROMPT_OVERFLOWS)
    number = isinstance(reward_timeout_s, int | float) and not isinstance(reward_timeout_s, bool)
    require(
        reward_timeout_s is None or (number and reward_timeout_s > 0),
        f"sampler.reward_timeout_s must be a number of seconds > 0, or null (no limit), got {reward_timeout_s!r}",
    )
    require(
        reward_timeout_s is None or reward_isolation != "none",
        f"sampler.reward_timeout_s={reward_timeout_s} needs sampler.reward_isolation 'thread' or 'process': "
        "with 'none' a reward function is called directly and cannot be stopped; set reward_timeout_s: null "
        "to call it without a time limit",
    )


def check_rollout_shape(data: DataSide, group_size: int, num_minibatches: int) -> None:
    """K must divide P x G, when the data module says what P is (``prompts_per_rollout``)."""
    prompts = data.prompts_per_rollout()
    if prompts is not None:
        check_divisible(prompts * group_size, num_minibatches)


def check_data_columns(data: DataSide, rewards: Sequence[Any], split: str, setting: str) -> None:
    """Rewards' ``required_columns`` against the data module's columns, once it is set up (PromptDataModule)."""
    if not data.offers("column_names"):
        return
    check_reward_columns(rewards, data.datamodule.column_names(split), data.describe_split(split), setting)


def check_chat_template(data: DataSide, tokenizer: Any, policy: Any = None) -> None:
    """Chat prompts need a tokenizer with a chat template; checked as soon as both are known (``policy``, the
    policy's loader, names it)."""
    if tokenizer is None or not data.chat():
        return
    if not getattr(tokenizer, "chat_template", None):
        raise SettingError(
            f"the data module builds chat prompts (data.init_args.chat_template: true) but the policy's tokenizer"
            f"{_named(policy)} has no chat template: set data.init_args.chat_template: false (and put the "
            f"instruction into data.init_args.prompt_template), or give the policy one: {chat_template_help('simple')}"
        )


def chat_template_help(template: str) -> str:
    """Which built-in policies have a chat template, and how to give one (``template``: the built-in to name)."""
    return (
        f"gspo_lightning.models.TinyQwen3 takes init_args.chat_template: {template} (a built-in by name, or a Jinja "
        "template), and so does a warm-started tiny policy through its base (model.init_args.policy.init_args.base: "
        f"{{class_path: gspo_lightning.models.TinyQwen3, init_args: {{chat_template: {template}}}}}); "
        "gspo_lightning.data.CalculatorWarmStartedTinyQwen3 has the tools one; a Pretrained chat or instruct "
        "checkpoint (e.g. Qwen/Qwen3-0.6B) brings its own"
    )


def _named(policy: Any) -> str:
    return f" ({type(policy).__module__}.{type(policy).__qualname__})" if policy is not None else ""


def check_rollout_correction(correction_mode: str, old_logprobs: str) -> None:
    """A rollout correction compares the trainer's pi_old with the engine's log-probs: pi_old must be recomputed."""
    require(
        correction_mode == "off" or old_logprobs == "recompute",
        f"model.rollout_correction.mode={correction_mode!r} compares the trainer's pi_old with the engine's "
        f"log-probs, so it needs sampler.old_logprobs: recompute, got sampler.old_logprobs: {old_logprobs!r}",
    )


OldLogprobSource = Literal["recompute", "engine"]


def validate_old_logprobs(old_logprobs: str) -> None:
    renamed = " (renamed: 'sampler' is now 'engine')" if old_logprobs == "sampler" else ""
    require_one_of("sampler.old_logprobs", old_logprobs, ("recompute", "engine"), renamed)


def validate_evaluation(
    every_n_steps: int, max_new_tokens: int | None, prompt_overflow: str, samples_per_prompt: int, temperature: float,
    top_p: float, top_k: int, pass_k: Sequence[int], solved_at: float, seed: int,
) -> None:  # fmt: skip
    """Every ``evaluation.*`` setting, checked before any model is built; each message names the setting."""
    require(every_n_steps >= 0, f"evaluation.every_n_steps must be >= 0 (0 disables it), got {every_n_steps}")
    require(
        max_new_tokens is None or max_new_tokens >= 1,
        f"evaluation.max_new_tokens must be >= 1 or null (the module's), got {max_new_tokens}",
    )
    require_one_of("evaluation.prompt_overflow", prompt_overflow, PROMPT_OVERFLOWS)
    require(
        samples_per_prompt >= 1,
        f"evaluation.samples_per_prompt must be >= 1 (1: one greedy decode per prompt), got {samples_per_prompt}",
    )
    require(
        temperature > 0,
        f"evaluation.temperature must be > 0 (it applies when samples_per_prompt > 1), got {temperature}",
    )
    require(0 < top_p <= 1, f"evaluation.top_p must be in (0, 1], got {top_p}")
    require(top_k >= 0, f"evaluation.top_k must be >= 0 (0 disables it), got {top_k}")
    ks = list(pass_k)
    require(len(ks) > 0, "evaluation.pass_k must name at least one k (e.g. [1])")
    in_range = all(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= samples_per_prompt for k in ks)
    require(
        in_range,
        f"evaluation.pass_k entries must be between 1 and evaluation.samples_per_prompt={samples_per_prompt}, "
        f"got {ks}: the unbiased pass@k estimate needs at least k samples per prompt (raise samples_per_prompt)",
    )
    require(len(set(ks)) == len(ks), f"evaluation.pass_k entries must be distinct, got {ks}")
    number = isinstance(solved_at, int | float) and not isinstance(solved_at, bool)
    require(
        number and math.isfinite(solved_at),
        f"evaluation.solved_at must be a finite number (a sample is solved when its score >= it), got {solved_at!r}",
    )
    require(
        isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0,
        f"evaluation.seed must be an integer >= 0, got {seed!r}",
    )


def check_prompt_lengths(data: DataSide, tokenizer: Any, context: int | None, max_new_tokens: int) -> None:
    """Every prompt of the data module's splits, tokenised as sampling tokenises it, fits the policy's context with
    ``max_new_tokens`` (``sampler.prompt_overflow: error``): checked at fit start, where a data module lists its
    prompts (``prompt_chunks``), so that one over-long row among thousands does not end a run when it is drawn."""
    if context is None or not data.offers("prompt_chunks"):
        return
    for split in ("train", "eval"):
        over = [(row, n, prompt) for row, n, prompt in _prompt_lengths(data, tokenizer, split)
                if n + max_new_tokens > context]  # fmt: skip
        if over:
            row, tokens, prompt = over[0]
            text = str(prompt)
            raise SettingError(
                f"row {row} (counting from 0) of {data.describe_split(split)}, the prompt "
                f"{text[:40] + '...' * (len(text) > 40)!r}, has {tokens} tokens: with model.max_new_tokens="
                f"{max_new_tokens} it needs {tokens + max_new_tokens} > the policy's context length {context} "
                f"({len(over)} prompt(s) of the split do); set sampler.prompt_overflow to 'truncate' or "
                f"'skip' (allowed: {list(PROMPT_OVERFLOWS)}), shorten those prompts or lower model.max_new_tokens"
            )


def round_need(data: DataSide, tokenizer: Any, split: str, sequences: int, new_tokens: int,
               context: int | None) -> RoundNeed:  # fmt: skip
    """What a round of ``sequences`` of ``split`` holds at once, for the engine's memory: each sequence up to the
    split's longest prompt (tokenised as sampling tokenises it) with ``new_tokens``, within ``context``; the
    context itself where the data module does not list its prompts."""
    longest = None
    if data.offers("prompt_chunks"):
        longest = max((n for _, n, _ in _prompt_lengths(data, tokenizer, split)), default=0) + new_tokens
    tokens = longest if longest is not None else context
    if tokens is not None and context is not None:
        tokens = min(tokens, context)
    return RoundNeed(sequences, tokens or new_tokens)


def _prompt_lengths(data: DataSide, tokenizer: Any, split: str) -> Iterator[tuple[int, int, Any]]:
    """(row, tokens, prompt) of every prompt of ``split``, tokenised as sampling tokenises it."""
    for start, prompts in data.datamodule.prompt_chunks(split):
        if prompts:
            lengths = encode_prompts(tokenizer, prompts, "cpu")[1].sum(-1).tolist()  # [P] prompt tokens
            yield from ((start + row, n, prompts[row]) for row, n in enumerate(lengths))


def check_micro_batch_budget(
    data: DataSide, tokenizer: Any, budget: int | None, max_new_tokens: int, context: int | None
) -> None:
    """The longest sequence the training data can make (its longest prompt, tokenised as sampling tokenises it,
    with ``max_new_tokens`` response tokens, within the context) fits ``model.micro_batch_tokens``: checked at
    fit start, not when the first long response is drawn. Padded micro-batches cost rows x that width at most."""
    if budget is None or not data.offers("prompt_chunks"):
        return
    longest = max((n for _, n, _ in _prompt_lengths(data, tokenizer, "train")), default=0)
    need = longest + max_new_tokens if context is None else min(longest + max_new_tokens, context)
    if need > budget:
        raise SettingError(
            f"model.micro_batch_tokens={budget} is smaller than the longest sequence the training data can make: "
            f"its longest prompt ({longest} tokens) with model.max_new_tokens={max_new_tokens} is {need} tokens; "
            f"set model.micro_batch_tokens to at least {need} (a sequence is never split across micro-batches)"
        )


def validate_episodes(episodes: Any, prompt_overflow: str, engine: SamplingEngine) -> None:
    """Settings that contradict multi-turn episodes, refused when the sampler is built."""
    if episodes is None:
        return
    require(
        prompt_overflow == "error",
        f"sampler.prompt_overflow={prompt_overflow!r} applies to single responses; an episode's first messages must "
        "fit and its turns stop at sampler.episodes.max_episode_tokens: set sampler.prompt_overflow: error",
    )
    require(
        engine.tensor_parallel_size == 1,
        "sampler.episodes with sampler.engine.tensor_parallel_size > 1 is not supported (every rank of a tensor-"
        "parallel engine would have to run the same episodes): use tensor_parallel_size: 1",
    )


def check_turn_advantages(episodes: Any, per_token_advantages: bool) -> None:
    """Per-turn advantages vary along a response: the module's loss must take one advantage per token."""
    require(
        episodes is None or not episodes.turn_advantages or per_token_advantages,
        "sampler.episodes.turn_advantages gives every token its turn's advantage, but the module's objective "
        "(model.init_args.objective) takes one advantage per response: use an objective with per-token advantages "
        "(e.g. gspo_token, grpo) or set turn_advantages: false",
    )


def check_episode_tokenizer(tokenizer: Any, policy: Any = None) -> None:
    """Episodes render their messages with the chat template, whose assistant messages end with EOS (``policy``,
    the policy's loader, names it)."""
    require(
        bool(getattr(tokenizer, "chat_template", None)),
        f"sampler.episodes renders the conversation with the tokenizer's chat template, but the policy's tokenizer"
        f"{_named(policy)} has none: give the policy one: {chat_template_help('tools')}",
    )


def validate_asynchronous(asynchronous: Any, old_logprobs: str, dynamic_sampling: bool, engine: SamplingEngine) -> None:
    """Settings that cannot go with sampling ahead of training, refused when the config is read."""
    if not asynchronous.enabled:
        return
    mode = f"sampler.asynchronous.mode={asynchronous.mode!r}"
    if asynchronous.mode == "streaming":
        require(
            engine.runs_in_background,
            f"{mode} needs an engine of its own that generates while the trainer trains (sampler.engine: "
            f"vllm_process, gspo_lightning.engines.VLLMProcessEngine); got {engine.name!r}. "
            "With hf or vllm use mode: fixed_lag",
        )
    require(
        old_logprobs == "recompute",
        f"{mode} needs sampler.old_logprobs: recompute (got {old_logprobs!r}): pi_old is then the proximal policy, "
        "the trainer's weights at the start of the round a sample is trained in; the engine's log-probs are the "
        "behaviour policy's, corrected for by model.rollout_correction",
    )
    require(
        not dynamic_sampling or asynchronous.mode == "streaming",
        f"{mode} does not support sampler.dynamic_sampling (a round sampled ahead would draw its extra prompts from "
        "a stream whose position must follow training): use asynchronous.mode: streaming, which replaces an "
        "uninformative group in its slot, or dynamic_sampling: false",
    )


def check_asynchronous(data: DataSide, correction_mode: str, asynchronous: Any) -> None:
    """At fit start: the data module serves any round's prompts by index, and a warning for an uncorrected run."""
    if not asynchronous.enabled:
        return
    data.needs("rollout_batch", f"sampler.asynchronous.mode={asynchronous.mode!r} (it samples rounds ahead)")
    if correction_mode == "off":
        rank_zero_warn(
            f"sampler.asynchronous.mode={asynchronous.mode!r} with model.rollout_correction.mode: off: samples come "
            f"from weights up to {asynchronous.rounds_ahead} version(s) older than pi_old (the proximal policy) and "
            "nothing weighs that gap; set model.rollout_correction.mode: tis (or mis) to correct it"
        )

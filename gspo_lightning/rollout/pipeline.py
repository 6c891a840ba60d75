"""The prompt side of sampling and how completions are scored, for training rounds and the evaluation alike:
prompts rendered and tokenised, fitted to the context (``prompt_overflow``), and the ``Scoring`` the reward
functions run under. The samples themselves come from the trajectory generator (``episodes/loop.py``), laid out
by ``rollout/trajectories.py``. No Lightning here.

A prompt overflows when its token count plus ``max_new_tokens`` exceeds the policy's context length. Truncation
is on the left: the last ``context - max_new_tokens`` prompt tokens are kept, so the end of the prompt (the
question, the chat template's generation prompt) survives and its beginning (a system prompt, few-shot examples,
BOS) is cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from gspo_lightning.rewards.isolation import RewardRunner
from gspo_lightning.rewards.scoring import RewardFunction
from gspo_lightning.rollout.types import Prompt
from gspo_lightning.validation import SettingError, require_one_of

PromptOverflow = Literal["error", "truncate", "skip"]

PROMPT_OVERFLOWS: tuple[str, ...] = ("error", "truncate", "skip")

# Tokenizers without a known limit report int(1e30) as model_max_length; configs sometimes hold junk too.
_LARGEST_PLAUSIBLE_CONTEXT = 10**8

def _plausible(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < _LARGEST_PLAUSIBLE_CONTEXT:
        return value
    return None

def context_length(policy: nn.Module | None, tokenizer: PreTrainedTokenizerBase | None) -> int | None:
    """The policy's ``config.max_position_embeddings``, else the tokenizer's ``model_max_length``, else None.

    A value that is missing, not a positive int or absurdly large (an unset tokenizer limit) does not count.
    A wrapper (``policy.module``, as some strategies add) is looked through.
    """
    config = getattr(policy, "config", None) or getattr(getattr(policy, "module", None), "config", None)
    from_config = _plausible(getattr(config, "max_position_embeddings", None))
    if from_config is not None:
        return from_config
    return _plausible(getattr(tokenizer, "model_max_length", None))

def fit_prompts_to_context(
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    max_new_tokens: int,
    context: int | None,
    overflow: PromptOverflow = "error",
    setting: str = "sampler.prompt_overflow",
) -> tuple[Tensor, Tensor, Tensor]:
    """Make every left-padded prompt fit ``context`` together with ``max_new_tokens`` response tokens.

    Args:
        prompt_ids: [P, Lp] left-padded prompt tokens.
        prompt_mask: [P, Lp] 1 on real prompt tokens.
        max_new_tokens: the response budget.
        context: the context length (None: unknown, nothing is checked).
        overflow: ``"error"`` raises naming the first overflowing prompt; ``"truncate"`` and ``"skip"`` both
            keep the last ``context - max_new_tokens`` tokens of every overflowing prompt (the caller leaves
            skipped prompts out of learning).
        setting: the setting's name, for the error message.

    Returns:
        prompt_ids: [P, Lp'] with Lp' = min(Lp, context - max_new_tokens) when anything overflows.
        prompt_mask: [P, Lp'].
        overflowed: [P] bool, True for the prompts that were (or would have been) cut.
    """
    require_one_of(setting, overflow, PROMPT_OVERFLOWS)
    lengths = prompt_mask.sum(-1)  # [P]
    if context is None:
        return prompt_ids, prompt_mask, lengths < 0  # [P, Lp], [P, Lp], [P] all False
    budget = context - max_new_tokens
    overflowed = lengths > budget  # [P]
    if not bool(overflowed.any()):
        return prompt_ids, prompt_mask, overflowed
    first = int(overflowed.nonzero()[0, 0])
    if overflow == "error" or budget < 1:
        reason = "lower max_new_tokens: no prompt token would fit" if budget < 1 else (
            f"set {setting} to 'truncate' or 'skip' (allowed: {list(PROMPT_OVERFLOWS)}), shorten the prompt or "
            "lower max_new_tokens")  # fmt: skip
        raise SettingError(
            f"prompt {first} of the batch has {int(lengths[first])} tokens; with max_new_tokens={max_new_tokens} "
            f"it needs {int(lengths[first]) + max_new_tokens} > the policy's context length {context} "
            f"({int(overflowed.sum())} prompt(s) of the batch overflow; {setting}={overflow!r}): {reason}"
        )
    # Left padding puts every prompt's real tokens at the right end, so the last `budget` columns hold the
    # last `budget` tokens of an overflowing prompt and the whole of every other one.
    return prompt_ids[:, -budget:], prompt_mask[:, -budget:], overflowed  # [P, budget] x2, [P]


@dataclass(frozen=True)
class Scoring:
    """How completions are scored: the reward functions, their weights, how they run and what a failure does;
    ``settings`` name the functions for an error (None: ``sampler.rewards[i]``)."""

    rewards: Sequence[RewardFunction]
    weights: Sequence[float]
    runner: RewardRunner | None = None
    errors: str = "raise"
    settings: Sequence[str] | None = None


def repeat_each(values: list[Any], times: int) -> list[Any]:
    """Each value ``times`` times in a row, matching ``repeat_interleave`` of the prompt rows."""
    return [value for value in values for _ in range(times)]


def render_prompt(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> str:
    """A plain prompt as is; a chat conversation through the tokenizer's chat template."""
    if isinstance(prompt, str):
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the prompts are chat messages (data chat_template=true) but the tokenizer has no chat template: "
            "set data.init_args.chat_template=false, or use a tokenizer that defines one"
        )
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)

def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: list[Prompt], device: torch.device | str
) -> tuple[Tensor, Tensor]:
    """Left-padded prompt ids and attention mask, [P, Lp] each."""
    texts = [render_prompt(tokenizer, p) for p in prompts]
    # A chat template already writes the special tokens the model expects.
    add_special = all(isinstance(p, str) for p in prompts)
    tokenizer.padding_side = "left"
    encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=add_special)
    return encoded["input_ids"].to(device), encoded["attention_mask"].to(device)

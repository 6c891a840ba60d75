"""Continuing token lists: one engine call that extends each of several token histories by one continuation.

An episode's next turn and a streaming sample's next chunk are both this: the history so far (prompt and every
token since, ids never re-encoded from text) left-padded into one batch, one continuation each, then each row's
new tokens up to and including EOS. No Lightning here.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import PreTrainedTokenizerBase

from gspo_lightning.engines.base import EngineSamples, SamplingEngine, SamplingSettings, padded

SEED_STRIDE = 1_000_003
"""Between the seeds of successive calls (turns, chunks): call k seeds its rows from seed + k * stride, so no two
calls share a random stream."""


def continue_token_lists(
    engine: SamplingEngine,
    policy: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    contexts: list[list[int]],
    settings: SamplingSettings,
    seed: int,
    with_logprobs: bool = False,
    synced_gpus: bool = False,
    device: Any = "cpu",
    group_size: int = 1,
) -> EngineSamples:
    """``group_size`` continuations of at most ``settings.max_new_tokens`` for each token list in ``contexts`` (one
    engine call; an empty list still makes the call, with one pad token, as a rank with nothing to do under sharded
    sampling must)."""
    pad = tokenizer.pad_token_id
    contexts = contexts or [[pad]]
    ids = padded(contexts, pad, left=True)  # [A, L]
    mask = padded([[1] * len(context) for context in contexts], 0, left=True)  # [A, L]
    return engine.sample(
        policy, tokenizer, ids.to(device), mask.to(device), settings, group_size, with_logprobs, synced_gpus, seed
    )


def new_tokens(row: list[int], eos_token_id: int, room: int) -> list[int]:
    """A continuation's tokens up to and including its first EOS (the engine pads after it), at most ``room``.

    A row without EOS ran to the call's ``max_new_tokens``, the longest of the batch: every token of it was
    sampled (a pad id among them too), and each lines up with its log-prob."""
    if eos_token_id in row:
        row = row[: row.index(eos_token_id) + 1]
    return row[:room]

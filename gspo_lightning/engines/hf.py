"""Sampling with Hugging Face ``generate`` on the trainer's own policy: the default engine, and the CPU path."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from gspo_lightning.engines.base import EngineSamples, SamplingEngine, ended_with_eos
from gspo_lightning.rollout.generation import SamplingSettings, generate_responses, generate_with_logprobs
from gspo_lightning.validation import require

SamplingDtype = Literal["auto", "bfloat16", "float16"]
_SAMPLING_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


class HFEngine(SamplingEngine):
    """``policy.generate`` on the policy being trained: no weights to copy, the same kernels as training.

    Args:
        share_prompt_prefill: compute each prompt's prefill (the forward over its tokens, kept as a key/value
            cache) once and share it among its G responses, instead of once per response. The same samples up to
            float rounding, for less prefill compute: it pays with long prompts and large G
            (``experiments/bench/sampling.py``). A policy whose cache holds more than attention keys and values
            (SSM / linear attention layers) samples without sharing, with a warning.
        sampling_dtype: precision of the sampling pass: ``auto`` (the trainer's, as training) or ``bfloat16`` /
            ``float16`` (autocast around ``generate``), e.g. to emulate a lower-precision inference engine.
    """

    name = "hf"

    def __init__(self, share_prompt_prefill: bool = True, sampling_dtype: SamplingDtype = "auto") -> None:
        require(
            sampling_dtype in ("auto", *_SAMPLING_DTYPES),
            f"sampler.engine.sampling_dtype must be one of ['auto', 'bfloat16', 'float16'], got {sampling_dtype!r}",
        )
        self.share_prompt_prefill = share_prompt_prefill
        self.sampling_dtype = sampling_dtype

    def sample(
        self,
        policy: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        settings: SamplingSettings,
        group_size: int,
        with_logprobs: bool = False,
        synced_gpus: bool = False,
        seed: int = 0,
    ) -> EngineSamples:
        arguments = (policy, tokenizer, prompt_ids, prompt_mask, settings, synced_gpus, group_size)
        share = self.share_prompt_prefill
        with sampling_precision(self.sampling_dtype, prompt_ids.device):
            if with_logprobs:
                response_ids, logprobs = generate_with_logprobs(*arguments, share)  # [N, R] x2
            else:
                response_ids, logprobs = generate_responses(*arguments, share), None  # [N, R]
        return EngineSamples(response_ids, ended_with_eos(response_ids, tokenizer.eos_token_id), logprobs)


@contextmanager
def sampling_precision(sampling_dtype: str, device: torch.device) -> Iterator[None]:
    """Autocast ``generate`` to ``sampling_dtype``; ``auto`` keeps the surrounding (training) precision."""
    if sampling_dtype == "auto":
        yield
        return
    with torch.autocast(device.type, dtype=_SAMPLING_DTYPES[sampling_dtype]):
        yield

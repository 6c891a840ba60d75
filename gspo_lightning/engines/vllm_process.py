"""vLLM on its own process (and, on GPUs, its own devices): the engine computes while the trainer trains.

The engine core runs in a process vLLM starts (``vllm.LLM`` with its multiprocessing on); this process keeps vLLM's
client. Weights reach the engine as a checkpoint the engine reloads in place, through vLLM's own
``collective_rpc("reload_weights", weights_path=...)``: the trainer writes each version once, as safetensors, to
shared memory (``/dev/shm`` where there is one), and the engine's loader reads it. This is the path that works on
every backend, CPUs included (vLLM's NCCL and CUDA-IPC weight-transfer engines need GPUs). It costs a write and a
read of the weights per version: negligible for small models, and on GPUs a full copy through host memory.

After every load a probe checks that the engine holds the trainer's weights: the log-probs of a fixed token
sequence (``PROBE_LENGTH`` tokens) under the engine's weights (its prompt log-probs) against the trainer's,
computed when the weights were written. A difference over ``sync_check_tolerance`` stops the run naming both
figures: a stale, partial or corrupted sync never samples a round.

Weight snapshots let asynchronous rollouts sample with older weights than the trainer's (``sampler.asynchronous``):
``snapshot_weights`` writes the current version, ``load_snapshot`` puts one into the engine. A snapshot's files go
when it is no longer referenced.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from gspo_lightning.engines.base import EngineSamples, SamplingEngine, SamplingSettings
from gspo_lightning.engines.vllm_options import VLLMDtype, VLLMOptions, architecture, base_model
from gspo_lightning.engines.vllm_options import check_cpu_head_size, engine_variables, import_vllm, sample_round
from gspo_lightning.engines.vllm_options import shut_down, vllm_environment
from gspo_lightning.engines.weight_sync import policy_weight_groups
from gspo_lightning.logprobs import response_logprobs
from gspo_lightning.strategies import fsdp1_root, inference_context
from gspo_lightning.validation import require

PROBE_LENGTH = 32
"""Tokens of the sequence whose log-probs check each sync."""

DEFAULT_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.25, "float16": 0.1}
"""Largest |log-prob difference| per probe token accepted between engine and trainer, by the engine's dtype: the
kernels' own disagreement is ~1e-5 in float32 on CPU; a sync that went wrong moves log-probs by far more."""


@dataclass
class WeightSnapshot:
    """One version of the trainer's weights, written for the engine.

    Attributes:
        step: the trainer's global step when it was taken.
        path: the directory holding ``config.json`` and ``model.safetensors``.
        probe_logprobs: [PROBE_LENGTH - 1] float32, the trainer's log-probs of the probe's tokens.
    """

    step: int
    path: str
    probe_logprobs: Tensor
    _finalizer: Any = field(default=None, repr=False)


class VLLMProcessEngine(SamplingEngine):
    """vLLM in a process of its own, fed by asynchronous rollouts (see the module docstring).

    Args:
        dtype, enforce_eager, kv_cache_gib, max_model_len, seed, gpu_memory_utilization: as ``VLLMEngine``'s.
        cpu_cores: CPUs only: the cores the engine's processes run on and its compute threads are bound to
            (``VLLM_CPU_OMP_THREADS_BIND``), e.g. ``"1"`` or ``"2-3"``, so that engine and trainer do not compete for
            the same cores (give the trainer the others, e.g. ``taskset``); null: vLLM's default.
        devices: GPUs only: ``CUDA_VISIBLE_DEVICES`` of each training rank's engine, by local rank (e.g. ``["1"]``
            for one trainer on GPU 0 and its engine on GPU 1); null: the engine sees what the trainer sees.
        sync_check_tolerance: the probe's largest accepted |log-prob difference| after a sync (null: by dtype,
            ``DEFAULT_TOLERANCE``).
        snapshot_dir: where weight snapshots are written (null: ``/dev/shm`` when it exists, else the temp dir).
    """

    name = "vllm_process"
    runs_in_background = True

    def __init__(
        self,
        dtype: VLLMDtype = "auto",
        enforce_eager: bool | None = None,
        kv_cache_gib: int = 1,
        max_model_len: int | None = None,
        seed: int = 0,
        gpu_memory_utilization: float = 0.9,
        cpu_cores: str | None = None,
        devices: list[str] | None = None,
        sync_check_tolerance: float | None = None,
        snapshot_dir: str | None = None,
    ) -> None:
        self.options = VLLMOptions(dtype, enforce_eager, kv_cache_gib, max_model_len, seed, gpu_memory_utilization)
        require(
            sync_check_tolerance is None or sync_check_tolerance > 0,
            f"sampler.engine.sync_check_tolerance must be > 0 or null, got {sync_check_tolerance!r}",
        )
        require(
            snapshot_dir is None or os.path.isdir(snapshot_dir),
            f"sampler.engine.snapshot_dir must be an existing directory or null, got {snapshot_dir!r}",
        )
        self.seed = seed
        self.cpu_cores = cpu_cores
        self.devices = devices
        self.sync_check_tolerance = sync_check_tolerance
        self.snapshot_dir = snapshot_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.llm: Any = None
        self.loaded: WeightSnapshot | None = None
        self.synced_step: int | None = None
        self._directory: str | None = None
        self._probe: Tensor | None = None
        self._engine_dtype = "float32"
        self._fsdp1: nn.Module | None = None
        self._snapshot_paths: list[str] = []  # every one written, removed at teardown at the latest
        self._watchdog: tuple[subprocess.Popen, int] | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.llm is not None:
            return
        self._fsdp1 = fsdp1_root(trainer)
        policy = pl_module.policy
        if pl_module.device.type == "cpu":
            check_cpu_head_size(policy)
        self._engine_dtype = self.options.resolved_dtype(policy, str(trainer.precision))
        self._probe = probe_tokens(base_model(policy).config.vocab_size, len(pl_module.tokenizer))
        first = self.snapshot_weights(trainer, pl_module)
        # The tokenizer lives apart from the snapshots, which come and go with the versions
        self._directory = tempfile.mkdtemp(prefix="gspo_lightning_vllm_")
        pl_module.tokenizer.save_pretrained(self._directory)
        shutil.copy(os.path.join(first.path, "config.json"), self._directory)  # vLLM reads a tokenizer's model config
        self.llm = self._build_process(first.path, pl_module.device, trainer.local_rank)
        self.loaded = None
        self.load_snapshot(first)  # the probe checks the loaded weights too

    def before_rollout(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Synchronous use (a round sampled with the current weights, the evaluation): load them if they changed."""
        if self.loaded is None or self.loaded.step != trainer.global_step:
            self.load_snapshot(self.snapshot_weights(trainer, pl_module))

    def after_rollout(self) -> None:
        """Nothing to free: the engine lives on its own devices."""

    def teardown(self) -> None:
        """Stop the engine, remove its files and the watchdog (never raises: see ``VLLMEngine.teardown``)."""
        llm, self.llm = self.llm, None
        if llm is not None:
            shut_down(llm)
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None
        self.loaded = None
        for path in self._snapshot_paths:
            shutil.rmtree(path, ignore_errors=True)
        self._snapshot_paths = []
        if self._watchdog is not None:  # closing our end makes it kill whatever of the engine is left, and exit
            watchdog, pipe = self._watchdog
            self._watchdog = None
            os.close(pipe)
            watchdog.wait(timeout=30)

    @torch.no_grad()
    def snapshot_weights(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> WeightSnapshot:
        """The trainer's current weights, written for the engine, with the trainer's probe log-probs. Every
        training rank calls this at the same point (a sharded policy is gathered one layer at a time)."""
        path = tempfile.mkdtemp(prefix="gspo_lightning_weights_", dir=self.snapshot_dir)
        self._snapshot_paths = [p for p in self._snapshot_paths if os.path.exists(p)] + [path]
        try:
            tensors: dict[str, Tensor] = {}
            for group in policy_weight_groups(pl_module.policy, self._fsdp1):
                for name, tensor in group:  # copied: a group's tensors may be live parameters or freed shards
                    tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()
            write_checkpoint(path, base_model(pl_module.policy), tensors)
            del tensors
            with inference_context(trainer):
                expected = probe_logprobs(pl_module.policy, self._probe_ids(), pl_module.device)  # [PROBE_LENGTH - 1]
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        snapshot = WeightSnapshot(trainer.global_step, path, expected)
        snapshot._finalizer = weakref.finalize(snapshot, shutil.rmtree, path, True)
        return snapshot

    def load_snapshot(self, snapshot: WeightSnapshot) -> None:
        """Put ``snapshot`` into the engine (unless it holds it already), then check it with the probe."""
        if self.loaded is snapshot:
            return
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": snapshot.path, "is_checkpoint_format": True})
        if not self.llm.reset_prefix_cache():  # KV blocks of the old weights must not serve the new ones
            raise RuntimeError("the vLLM engine could not reset its prefix cache after a weight sync")
        self.check_sync(snapshot)
        self.loaded = snapshot
        self.synced_step = snapshot.step

    def check_sync(self, snapshot: WeightSnapshot) -> None:
        """Raise unless the engine's probe log-probs are the trainer's, within the tolerance."""
        engine = self.engine_probe_logprobs()  # [PROBE_LENGTH - 1]
        difference = float((engine - snapshot.probe_logprobs).abs().max())
        tolerance = self.sync_check_tolerance or DEFAULT_TOLERANCE.get(self._engine_dtype, 0.25)
        if not difference <= tolerance:  # NaN fails too
            raise RuntimeError(
                f"weight sync check failed at step {snapshot.step}: the engine's log-probs of the probe sequence "
                f"differ from the trainer's by up to {difference:.3g} (sampler.engine.sync_check_tolerance: "
                f"{tolerance:g}); the engine does not hold the trainer's weights, so no round is sampled with them"
            )

    def engine_probe_logprobs(self) -> Tensor:
        """[PROBE_LENGTH - 1] float32: the engine's log-probs of the probe's tokens 1.. given those before."""
        vllm = import_vllm()
        params = vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False, seed=0)
        ids = self._probe_ids().tolist()
        output = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        entries = output.prompt_logprobs[1:]  # the first token has no log-prob
        return torch.tensor([entry[token].logprob for token, entry in zip(ids[1:], entries)], dtype=torch.float32)

    def _probe_ids(self) -> Tensor:
        if self._probe is None:
            raise RuntimeError("VLLMProcessEngine.setup must run before its weights are synced")
        return self._probe

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
        if self.loaded is None:
            raise RuntimeError("VLLMProcessEngine.sample before any weights were loaded (setup or load_snapshot)")
        return sample_round(self.llm, prompt_ids, prompt_mask, settings, group_size, with_logprobs, seed,
                            tokenizer.pad_token_id)  # fmt: skip

    def _build_process(self, path: str, device: torch.device, local_rank: int) -> Any:
        with open(os.path.join(path, "config.json")) as handle:
            context = json.load(handle).get("max_position_embeddings", 0)
        arguments = self.options.llm_arguments(path, self._engine_dtype, device, context)
        arguments.update(tokenizer=self._directory, load_format="safetensors")
        variables = engine_variables(False, device, self.options.kv_cache_gib)
        cores = None
        if device.type == "cpu" and self.cpu_cores is not None:
            cores = core_set(self.cpu_cores)
            variables["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_cores
        if device.type == "cuda" and self.devices is not None:
            require(
                local_rank < len(self.devices),
                f"sampler.engine.devices lists {len(self.devices)} entries but local rank {local_rank} needs one",
            )
            # the engine's processes inherit it; this process' CUDA context exists already and keeps its devices
            variables["CUDA_VISIBLE_DEVICES"] = self.devices[local_rank]
        before = _children()
        with _affinity(cores), vllm_environment(variables):
            llm = import_vllm().LLM(**arguments)
        self._watchdog = stop_with_this_process(sorted(_children() - before))
        return llm


_WATCHDOG = """
import os, signal, sys
sys.stdin.buffer.read()  # returns when the trainer's end of the pipe closes: it exited, or was killed
for pid in map(int, sys.argv[1:]):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
"""


def stop_with_this_process(pids: list[int]) -> tuple[subprocess.Popen, int] | None:
    """A watchdog that kills ``pids`` (the engine's processes) when this process ends, however it ends.

    vLLM's engine core does not watch the process that started it: a trainer killed with SIGKILL (out of memory, a
    scheduler's pre-emption) would leave it running, holding its cores or GPU memory. The watchdog blocks on a pipe
    this process holds the other end of, which the kernel closes when this process dies (or ``teardown`` closes it).
    Returns the watchdog and this process' end of the pipe."""
    if not pids:
        return None
    read, write = os.pipe()
    watchdog = subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, *map(str, pids)], stdin=read, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    os.close(read)
    os.set_inheritable(write, False)  # only this process holds it: a child outliving it must not keep it open
    return watchdog, write


def _children() -> set[int]:
    import psutil

    return {child.pid for child in psutil.Process().children(recursive=True)}


def core_set(cores: str | None) -> set[int] | None:
    """``"1"``, ``"2-3"`` or ``"0,2-3"`` as a set of core numbers (None stays None)."""
    if cores is None:
        return None
    chosen: set[int] = set()
    try:
        for part in cores.split(","):
            low, _, high = part.partition("-")
            chosen.update(range(int(low), int(high or low) + 1))
    except ValueError:
        chosen = set()
    available = set(range(os.cpu_count() or 1))  # not this process' own affinity: the trainer's may be narrower
    require(
        bool(chosen) and chosen <= available,
        f"sampler.engine.cpu_cores must name cores of this machine, like '1' or '2-3' (cores 0-{max(available)}), "
        f"got {cores!r}",
    )
    return chosen


@contextmanager
def _affinity(cores: set[int] | None) -> Iterator[None]:
    """This process on ``cores`` while the engine's processes start, which inherit it (their scheduler threads as
    well as their compute threads: the trainer's cores stay the trainer's); then back."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def write_checkpoint(path: str, model: nn.Module, tensors: dict[str, Tensor]) -> None:
    """A Hugging Face checkpoint directory of ``tensors`` (config.json naming the architecture, one safetensors)."""
    from safetensors.torch import save_file

    config = model.config.to_dict()
    config["architectures"] = [architecture(model)]
    with open(os.path.join(path, "config.json"), "w") as handle:
        json.dump(config, handle)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def probe_tokens(vocab_size: int, tokenizer_size: int) -> Tensor:
    """[PROBE_LENGTH] int64: a fixed sequence of token ids both vocabularies have (a seeded draw)."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, min(vocab_size, tokenizer_size), (PROBE_LENGTH,), generator=generator)


def probe_logprobs(policy: nn.Module, probe: Tensor, device: torch.device) -> Tensor:
    """[PROBE_LENGTH - 1] float32 on the CPU: the policy's log-probs (temperature 1) of the probe's tokens 1..."""
    ids = probe[None].to(device)  # [1, T]
    return response_logprobs(policy, ids, torch.ones_like(ids), ids.shape[1] - 1, 1.0)[0].float().cpu()


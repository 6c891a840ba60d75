"""vLLM on its own process (and, on GPUs, its own devices): the engine computes while the trainer trains.

The engine core runs in a process vLLM starts (``vllm.LLM`` with its multiprocessing on); this process keeps vLLM's
client. Weights reach the engine as checkpoint files it reloads in place through vLLM's own
``collective_rpc("reload_weights", weights_path=...)``, checked by a probe after every load
(:mod:`gspo_lightning.engines.weight_snapshots`): the path that works on every backend, CPUs included.

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
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from gspo_lightning.engines.base import EngineSamples, SamplingEngine, SamplingSettings, refuse_routes
from gspo_lightning.engines.vllm_options import VLLMDtype, VLLMOptions
from gspo_lightning.engines.vllm_options import check_cpu_head_size, engine_variables, import_vllm, sample_round
from gspo_lightning.engines.vllm_options import shut_down, vllm_environment
from gspo_lightning.engines.vllm_routes import PolicyRoutes, recorded_routes, routes_refusal
from gspo_lightning.engines.weight_snapshots import WeightSnapshot, WeightSnapshots, model_directory
from gspo_lightning.validation import require

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
        kv_cache_gib: float | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
        gpu_memory_utilization: float = 0.9,
        cpu_cores: str | None = None,
        devices: list[str] | None = None,
        sync_check_tolerance: float | None = None,
        snapshot_dir: str | None = None,
    ) -> None:
        self.options = VLLMOptions(dtype, enforce_eager, kv_cache_gib, max_model_len, seed, gpu_memory_utilization)
        self.snapshots = WeightSnapshots(snapshot_dir, sync_check_tolerance)
        self.seed = seed
        self.cpu_cores = cpu_cores
        self.devices = devices
        self.llm: Any = None
        self.loaded: WeightSnapshot | None = None
        self.synced_step: int | None = None
        self._directory: str | None = None
        self._watchdog: tuple[subprocess.Popen, int] | None = None
        self._routes: PolicyRoutes | None = None  # as VLLMEngine's

    def routes_refusal(self, device: torch.device) -> str | None:
        return routes_refusal(device)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.llm is not None:
            return
        policy = pl_module.policy
        if pl_module.device.type == "cpu":
            check_cpu_head_size(policy)
        self.snapshots.setup(trainer, pl_module, self.options.resolved_dtype(policy, str(trainer.precision)))
        self._routes = recorded_routes(policy, pl_module.routing_replay, self.routes_refusal(pl_module.device))
        self.records_routes = self._routes is not None
        first = self.snapshot_weights(trainer, pl_module)
        self._directory = model_directory(first, pl_module.tokenizer)
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
        self.snapshots.close()
        if self._watchdog is not None:  # closing our end makes it kill whatever of the engine is left, and exit
            watchdog, pipe = self._watchdog
            self._watchdog = None
            os.close(pipe)
            watchdog.wait(timeout=30)

    def snapshot_weights(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> WeightSnapshot:
        """The trainer's current weights, written for the engine (see ``WeightSnapshots.take``)."""
        return self.snapshots.take(trainer, pl_module)

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
        self.snapshots.check(snapshot, self.engine_probe_logprobs())

    def engine_probe_logprobs(self) -> Tensor:
        """[PROBE_LENGTH - 1] float32: the engine's log-probs of the probe's tokens 1.. given those before."""
        vllm = import_vllm()
        params = vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False, seed=0)
        ids = self.snapshots.probe_ids().tolist()
        output = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        entries = output.prompt_logprobs[1:]  # the first token has no log-prob
        return torch.tensor([entry[token].logprob for token, entry in zip(ids[1:], entries)], dtype=torch.float32)

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
        if self.loaded is None:
            raise RuntimeError("VLLMProcessEngine.sample before any weights were loaded (setup or load_snapshot)")
        return sample_round(self.llm, prompt_ids, prompt_mask, settings, group_size, with_logprobs, seed,
                            tokenizer.pad_token_id, self._routes if with_routes else None)  # fmt: skip

    def _build_process(self, path: str, device: torch.device, local_rank: int) -> Any:
        with open(os.path.join(path, "config.json")) as handle:
            config = json.load(handle)
        arguments = self.options.llm_arguments(path, self.snapshots.engine_dtype, device, config, self.need,
                                               self.records_routes)  # fmt: skip
        arguments.update(tokenizer=self._directory, load_format="safetensors")
        variables = engine_variables(False)
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

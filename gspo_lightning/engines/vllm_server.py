"""vLLM as servers (``vllm serve``): inference on cores, GPUs or machines of its own.

The engine samples from one or more vLLM OpenAI-compatible servers, token ids in and out
(:mod:`gspo_lightning.engines.server_client`). Either their URLs are given (servers the user started, on other
machines for instance), or the engine starts ``servers`` of them on this machine, each on the cores or GPUs it is
given, and stops them with the run (a single-node user needs no second command).

Each weight version reaches every server through the server's RL endpoints: pause (requests in flight finish),
update, reset the prefix cache, resume; then the probe check of :mod:`gspo_lightning.engines.weight_snapshots` on
each server, which stops the run on a mismatch. The update is ``weight_transfer`` (see
:mod:`gspo_lightning.engines.weight_transfer`): on GPUs vLLM's NCCL broadcast (or CUDA IPC for a server on the
trainer's own GPU); on CPUs checkpoint files the server reloads (``collective_rpc("reload_weights")``), which must
be readable by the servers (``snapshot_dir`` on a shared file system for servers on other machines).

A LoRA policy's versions travel as its adapter alone where vLLM can apply it (``lora_sync``, see
:mod:`gspo_lightning.engines.lora_adapters`): the servers hold the frozen base and load each version's adapter.

Servers started by the engine run with ``VLLM_SERVER_DEV_MODE=1`` (which mounts ``/collective_rpc`` and
``/reset_prefix_cache``); servers the user starts need it too.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import threading
import time

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from gspo_lightning.engines.base import EngineSamples, SamplingEngine, SamplingSettings, padded, refuse_routes
from gspo_lightning.engines.lora_adapters import LORA_SYNCS, LoRASync, check_server_lora, resolve_lora_sync
from gspo_lightning.engines.lora_adapters import served_adapter_name, server_lora_flags
from gspo_lightning.engines.server_client import Servers
from gspo_lightning.engines.server_launch import require_free, serve_command, start_server, stop_server
from gspo_lightning.engines.server_launch import wait_until_healthy
from gspo_lightning.engines.vllm_options import VLLMDtype, VLLMOptions, base_model, check_cpu_head_size
from gspo_lightning.engines.vllm_options import engine_variables
from gspo_lightning.engines.vllm_process import core_set, stop_with_this_process
from gspo_lightning.engines.vllm_routes import PolicyRoutes, engine_routes, recorded_routes, routes_refusal
from gspo_lightning.engines.vllm_routes import SERVER_FLAG, server_without_routes
from gspo_lightning.engines.weight_snapshots import WeightSnapshot, WeightSnapshots, model_directory
from gspo_lightning.engines.weight_transfer import TRANSFERS, TransferLink, WeightTransfer, resolve_transfer
from gspo_lightning.engines.weight_transfer import server_flags, server_workers
from gspo_lightning.validation import require, require_one_of

SERVED_NAME = "policy"
"""The served model's name on servers the engine starts (``--served-model-name``)."""
TOKENIZER_CHECK = "GSPO 12+34=46, déjà vu\n<|im_end|>"
"""Text both tokenizers must split into the same ids: digits, punctuation, accents, a newline, a chat marker."""


class VLLMServerEngine(SamplingEngine):
    """Samples from vLLM servers (see the module docstring).

    Args:
        urls: base URLs of running servers (e.g. ``["http://node7:8000"]``), started with
            ``VLLM_SERVER_DEV_MODE=1`` and ``--logprobs-mode processed_logprobs --generation-config vllm``; null:
            the engine starts ``servers`` on this machine.
        servers: how many servers the engine starts when ``urls`` is null (>= 1).
        cpu_cores: CPUs, servers the engine starts: the cores of each server (e.g. ``["1"]`` or ``["2", "3"]``),
            one entry per server; null: vLLM's default.
        devices: GPUs, servers the engine starts: ``CUDA_VISIBLE_DEVICES`` of each server (e.g. ``["1", "2"]``).
        port: the first port of the servers the engine starts (server i listens on ``port + i``, on 127.0.0.1).
        model: the served model's name on servers given by ``urls`` (null: the first ``/v1/models`` lists).
        request_timeout: seconds one request may take before it counts as failed.
        retry_seconds: how long a failing request is retried (on the other servers too) before the run stops.
        startup_timeout: seconds a server the engine starts may take to answer ``/health``.
        weight_transfer: how weight versions reach the servers: ``auto`` (``nccl`` on CUDA GPUs, else ``file``),
            ``file`` (safetensors the servers reload), ``nccl`` (vLLM's NCCL broadcast; servers given by ``urls``
            need ``--weight-transfer-config '{"backend": "nccl"}'``) or ``ipc`` (vLLM's CUDA IPC, a server on the
            trainer's own GPU).
        transfer_address: where servers reach this process for the NCCL rendezvous (null: 127.0.0.1 for servers
            the engine starts, this host's name for ``urls``).
        transfer_port: the first NCCL rendezvous port (rank r's server i uses ``transfer_port + r * n + i``).
        lora_sync: a LoRA policy's versions: ``auto`` (the adapter alone where vLLM can apply it and
            ``weight_transfer`` is ``auto`` or ``file``, else merged weights), ``adapter`` (refused where vLLM
            cannot; servers given by ``urls`` need ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``,
            and must read ``snapshot_dir``) or ``merged`` (the adapter merged into full weights, every version).
        dtype, enforce_eager, kv_cache_gib, max_model_len, seed, gpu_memory_utilization: as ``VLLMEngine``'s (for
            the servers the engine starts; ``seed`` seeds every request either way).
        sync_check_tolerance, snapshot_dir: as ``VLLMProcessEngine``'s.
    """

    name = "vllm_server"
    runs_in_background = True
    reports_logprobs_cheaply = True

    def __init__(
        self,
        urls: list[str] | None = None,
        servers: int = 1,
        cpu_cores: list[str] | None = None,
        devices: list[str] | None = None,
        port: int = 8100,
        model: str | None = None,
        request_timeout: float = 600.0,
        retry_seconds: float = 60.0,
        startup_timeout: float = 600.0,
        weight_transfer: WeightTransfer = "auto",
        transfer_address: str | None = None,
        transfer_port: int = 29700,
        lora_sync: LoRASync = "auto",
        dtype: VLLMDtype = "auto",
        enforce_eager: bool | None = None,
        kv_cache_gib: float | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
        gpu_memory_utilization: float = 0.9,
        sync_check_tolerance: float | None = None,
        snapshot_dir: str | None = None,
    ) -> None:
        require(urls is None or (len(urls) > 0 and all(u.startswith(("http://", "https://")) for u in urls)),
                f"sampler.engine.urls must be a non-empty list of http(s):// URLs or null, got {urls!r}")  # fmt: skip
        require(isinstance(servers, int) and servers >= 1, f"sampler.engine.servers must be >= 1, got {servers!r}")
        for setting, entries in (("cpu_cores", cpu_cores), ("devices", devices)):
            require(entries is None or len(entries) == servers,
                    f"sampler.engine.{setting} needs one entry per server ({servers}), got {entries!r}")  # fmt: skip
        for setting, value in (("request_timeout", request_timeout), ("retry_seconds", retry_seconds),
                               ("startup_timeout", startup_timeout)):  # fmt: skip
            require(value > 0, f"sampler.engine.{setting} must be > 0 seconds, got {value!r}")
        require(1 <= port <= 65535 - servers, f"sampler.engine.port must be a free port number, got {port!r}")
        require_one_of("sampler.engine.weight_transfer", weight_transfer, TRANSFERS)
        require_one_of("sampler.engine.lora_sync", lora_sync, LORA_SYNCS)
        require(1 <= transfer_port <= 65000,
                f"sampler.engine.transfer_port must be a port number, got {transfer_port!r}")  # fmt: skip
        if cpu_cores is not None:
            for cores in cpu_cores:
                core_set(cores)  # names the setting when a core does not exist
        self.urls = urls
        self.servers = servers
        self.cpu_cores = cpu_cores
        self.devices = devices
        self.port = port
        self.model = model
        self.timeouts = (request_timeout, retry_seconds, startup_timeout)
        self.weight_transfer = weight_transfer
        self.transfer_endpoint = (transfer_address, transfer_port)
        self.transfer = "file"  # resolved for the trainer's device at setup
        self.links: list[TransferLink] = []
        self.lora_sync = lora_sync
        self.adapters = False  # resolved for the policy at setup: versions are adapters on a served base
        self._adapter_versions = 0
        self._run = secrets.token_hex(4)  # in the adapters' names: two runs on one server never share one
        self.seed = seed
        self.options = VLLMOptions(dtype, enforce_eager, kv_cache_gib, max_model_len, seed, gpu_memory_utilization) \
            if urls is None else None  # fmt: skip
        self.snapshots = WeightSnapshots(snapshot_dir, sync_check_tolerance)
        self.client: Servers | None = None
        self.loaded: WeightSnapshot | None = None
        self.synced_step: int | None = None
        self._sync_figures = {"syncs": 0, "sync_s": 0.0, "snapshot_s": 0.0, "sync_bytes": 0}
        self._figures_lock = threading.Lock()  # syncs run on the sampling thread, figures are taken on the trainer's
        self._started: list[subprocess.Popen] = []
        self._watchdogs: list[tuple[subprocess.Popen, int]] = []
        self._directory: str | None = None
        self._routes: PolicyRoutes | None = None  # the policy's, once set up on servers that report them
        self._routes_missing: str | None = None  # why servers given by urls report none (found at setup)

    def routes_refusal(self, device: torch.device) -> str | None:
        """Started here, as ``VLLMEngine``'s; servers given by ``urls`` are asked at setup."""
        return self._routes_missing or (routes_refusal(device) if self.urls is None else None)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.client is not None:
            return
        policy = pl_module.policy
        dtype = self.options.resolved_dtype(policy, str(trainer.precision)) if self.options else "auto"
        self.snapshots.setup(trainer, pl_module, dtype)
        self.adapters = resolve_lora_sync(self.lora_sync, policy, self.weight_transfer)
        self.transfer = "file" if self.adapters else resolve_transfer(self.weight_transfer, pl_module.device)
        # a file: what servers the engine starts load first (of a LoRA policy synced as adapters, the base)
        first = self.snapshots.take(trainer, pl_module, lora="base" if self.adapters else "merged")
        self._routes = recorded_routes(policy, pl_module.routing_replay, self.routes_refusal(pl_module.device))
        self.records_routes = self._routes is not None
        request_timeout, retry_seconds, startup_timeout = self.timeouts
        if self.urls is None:
            require(trainer.world_size == 1,
                    f"sampler.engine: vllm_server starts servers for one training rank, this run has "
                    f"{trainer.world_size}: start them yourself and give sampler.engine.urls (at least one per "
                    "rank)")  # fmt: skip
            if pl_module.device.type == "cpu":
                check_cpu_head_size(policy)
            self._directory = model_directory(first, pl_module.tokenizer)
            urls = self._start_servers(first.path, pl_module.device, dtype, policy)
            model = SERVED_NAME
        else:
            urls = rank_servers(self.urls, trainer.global_rank, trainer.world_size)
            model = self.model
        self.client = Servers(urls, request_timeout, retry_seconds, model or "")
        if model is None:
            self.client.model = self.client.describe_model(0)["id"]
        self._check_servers(policy, pl_module.tokenizer)
        if self.records_routes and self.urls is not None:
            self._check_server_routes(trainer)
        self.loaded = None
        self.load_snapshot(first)
        if self.adapters:  # the base checked, then the first adapter
            self.load_snapshot(self.snapshot_weights(trainer, pl_module))
        if self.transfer != "file":
            self._open_links(trainer, self.snapshot_weights(trainer, pl_module))

    def _open_links(self, trainer: pl.Trainer, version: WeightSnapshot) -> None:
        """One vLLM transfer engine per server of this rank, opened with ``version``'s tensors, which it then
        holds (so the sync after the first is checked like every other)."""
        assert self.client is not None and version.tensors is not None
        address, port = self.transfer_endpoint
        address = address or ("127.0.0.1" if self.urls is None else socket.getfqdn())
        first_port = port + trainer.global_rank * len(self.client.urls)
        for index, url in enumerate(self.client.urls):
            workers = server_workers(self.client.server_info(index), self.transfer, url)
            self.links.append(TransferLink(self.transfer, url, version.tensors, workers, address, first_port + index,
                                           self.timeouts[0]))  # fmt: skip
        self.load_snapshot(version)

    def _check_servers(self, policy: nn.Module, tokenizer: PreTrainedTokenizerBase) -> None:
        """Refuse, at fit start, a server whose model cannot be the policy's: another name, another tokenizer (the
        ids of ``TOKENIZER_CHECK``), a shorter context."""
        context = self.options.max_model_len if self.options and self.options.max_model_len else None
        wanted = context or getattr(base_model(policy).config, "max_position_embeddings", None)
        assert self.client is not None
        for index, url in enumerate(self.client.urls):
            card = self.client.describe_model(index)
            require(card.get("id") == self.client.model,
                    f"vLLM server {url} serves {card.get('id')!r}, but sampler.engine.model is "
                    f"{self.client.model!r}")  # fmt: skip
            theirs = self.client.tokenize(index, TOKENIZER_CHECK)
            ours = tokenizer(TOKENIZER_CHECK, add_special_tokens=False)["input_ids"]
            require(theirs == ours,
                    f"vLLM server {url} tokenizes {TOKENIZER_CHECK!r} as {theirs}, the policy's tokenizer as {ours}: "
                    "it serves another vocabulary")  # fmt: skip
            length = card.get("max_model_len")
            require(wanted is None or length is None or int(length) >= int(wanted),
                    f"vLLM server {url} has context length {length}, the policy {wanted}: start it with "
                    f"--max-model-len {wanted}")  # fmt: skip
            if self.adapters and self.urls is not None:
                check_server_lora(self.client.server_info(index), url, policy)

    def _check_server_routes(self, trainer: pl.Trainer) -> None:
        """Servers given by ``urls`` report routes only if started with them: found out here, and agreed over the
        training ranks (each asks its own servers), so that R3 stops on every rank, not on one while the others
        wait in a collective (the refusal then comes from the sampler's check after setup)."""
        assert self.client is not None
        for index, url in enumerate(self.client.urls):
            self._routes_missing = self._routes_missing or server_without_routes(self.client.server_info(index), url)
        if not trainer.strategy.reduce_boolean_decision(self._routes_missing is None, all=True):
            self._routes_missing = self._routes_missing or (
                f"a vLLM server of another training rank was started without {SERVER_FLAG}"
            )
            self._routes, self.records_routes = None, False

    def before_rollout(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Synchronous use (a round sampled with the current weights, the evaluation): sync them if they changed."""
        if self.loaded is None or self.loaded.step != trainer.global_step:
            self.load_snapshot(self.snapshot_weights(trainer, pl_module))

    def snapshot_weights(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> WeightSnapshot:
        """The trainer's current weights, written for the servers (see ``WeightSnapshots.take``)."""
        started = time.perf_counter()
        snapshot = self.snapshots.take(trainer, pl_module, in_memory=self.transfer != "file",
                                       lora="adapter" if self.adapters else "merged")  # fmt: skip
        with self._figures_lock:
            self._sync_figures["snapshot_s"] += time.perf_counter() - started
        return snapshot

    def load_snapshot(self, snapshot: WeightSnapshot) -> None:
        """Every server loads ``snapshot`` (unless they hold it already); the probe then checks each."""
        if self.loaded is snapshot:
            return
        assert self.client is not None, "VLLMServerEngine.setup must run before its weights are synced"
        started = time.perf_counter()
        ids = self.snapshots.probe_ids().tolist()
        adapter = None
        if snapshot.lora == "adapter":
            self._adapter_versions += 1
            adapter = served_adapter_name(self.client.model, self._run, self._adapter_versions)
        for index, url in enumerate(self.client.urls):
            if adapter is not None:
                self.client.load_adapter(index, adapter, str(snapshot.path))
            elif snapshot.path is not None:
                self.client.reload(index, snapshot.path)
            else:
                assert snapshot.tensors is not None and self.links, "an in-memory version needs the transfer engines"
                with self.client.paused(index):
                    self.links[index].send(snapshot.tensors)
            logprobs = self.client.prompt_logprobs(index, ids, adapter)
            self.snapshots.check(snapshot, torch.tensor(logprobs), where=f"the vLLM server {url}")  # [PROBE_LENGTH - 1]
        if snapshot.lora != "merged":
            self._sample_with(adapter)
        self.loaded = snapshot
        self.synced_step = snapshot.step
        with self._figures_lock:
            figures = self._sync_figures
            figures.update(syncs=figures["syncs"] + 1, sync_s=figures["sync_s"] + time.perf_counter() - started,
                           sync_bytes=figures["sync_bytes"] + snapshot.nbytes)  # fmt: skip

    def _sample_with(self, adapter: str | None) -> None:
        """Later requests name ``adapter`` (None: the base); the servers forget the one they named before."""
        assert self.client is not None
        previous, self.client.adapter = self.client.adapter, adapter
        if previous is not None:
            for index in range(len(self.client.urls)):
                self.client.unload_adapter(index, previous)

    def take_figures(self) -> dict[str, float]:
        """Since the last call: ``syncs``, ``sync_s`` (pause, reload, cache reset, resume and probe on every
        server), ``snapshot_s`` (writing the versions), ``sync_bytes`` (per server), and each server's request
        figures (``Servers.take_figures``)."""
        with self._figures_lock:
            figures, self._sync_figures = self._sync_figures, dict.fromkeys(self._sync_figures, 0)
        return {**figures, **(self.client.take_figures() if self.client is not None else {})}

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
        if self.client is None or self.loaded is None:
            raise RuntimeError("VLLMServerEngine.sample before any weights were synced (setup or load_snapshot)")
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]  # P lists
        completions = self.client.complete(prompts, settings, group_size, with_logprobs, seed, with_routes)
        device = prompt_ids.device
        response_ids = padded([c.token_ids for c in completions], tokenizer.pad_token_id).to(device)  # [N, R]
        ended = torch.tensor([c.ended for c in completions], device=device)  # [N]
        logprobs = routes = None
        if with_logprobs:
            rows = [c.logprobs or [] for c in completions]
            logprobs = padded(rows, 0.0, torch.float32)[:, : response_ids.shape[1]].to(device)  # [N, R]
        if with_routes:  # [N, layers, Lp + R, k]
            assert self._routes is not None
            lengths = [len(prompts[row // group_size]) for row in range(len(completions))]
            routes = engine_routes([c.routes for c in completions], lengths, [len(c.token_ids) for c in completions],
                                   prompt_ids.shape[1], response_ids.shape[1], self._routes)  # fmt: skip
        return EngineSamples(response_ids, ended, logprobs, routes)

    def teardown(self) -> None:
        """Stop the servers the engine started and remove its files (never raises)."""
        self.client = None
        self.loaded = None
        for link in self.links:
            link.close()
        self.links = []
        self.snapshots.close()
        for process in self._started:
            stop_server(process)
        self._started = []
        for watchdog, pipe in self._watchdogs:
            os.close(pipe)
            watchdog.wait(timeout=30)
        self._watchdogs = []
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None

    def _start_servers(self, weights: str, device: torch.device, dtype: str, policy: nn.Module) -> list[str]:
        """Start ``servers`` vLLM servers from the checkpoint at ``weights``; their URLs once all answer."""
        assert self.options is not None and self._directory is not None
        with open(os.path.join(weights, "config.json")) as handle:
            config = json.load(handle)
        arguments = self.options.llm_arguments(weights, dtype, device, config, self.need, self.records_routes)
        arguments.update(tokenizer=self._directory, load_format="safetensors", served_model_name=SERVED_NAME)
        transfer_arguments, transfer_variables = server_flags(self.transfer)
        lora_arguments, lora_variables = server_lora_flags(policy) if self.adapters else ({}, {})
        arguments.update(transfer_arguments, **lora_arguments)
        transfer_variables = {**transfer_variables, **lora_variables}
        urls, logs = [], []
        for index in range(self.servers):
            port = self.port + index
            variables = {**engine_variables(False), "VLLM_SERVER_DEV_MODE": "1", **transfer_variables}
            if self.cpu_cores is not None:
                variables["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_cores[index]
            if self.devices is not None:
                variables["CUDA_VISIBLE_DEVICES"] = self.devices[index]
            require_free(port, f"sampler.engine.port ({self.port}, server {index} on {self.port} + {index})")
            cores = core_set(self.cpu_cores[index]) if self.cpu_cores else None
            process, log = start_server(serve_command(dict(arguments), port), variables, cores, port)
            self._started.append(process)
            watchdog = stop_with_this_process([-process.pid])  # its process group: the server and its engine core
            if watchdog is not None:
                self._watchdogs.append(watchdog)
            urls.append(f"http://127.0.0.1:{port}")
            logs.append(log)
        for url, process, log in zip(urls, self._started, logs):
            wait_until_healthy(url, process, log, self.timeouts[2])
        return urls


def rank_servers(urls: list[str], rank: int, world_size: int) -> list[str]:
    """The servers training rank ``rank`` of ``world_size`` samples from and syncs: every ``world_size``-th one,
    so that no server is fed weights by two ranks and every rank has as many."""
    require(len(urls) % world_size == 0,
            f"sampler.engine.urls lists {len(urls)} servers for {world_size} training ranks: each rank needs as many "
            "of its own (a multiple of the ranks)")  # fmt: skip
    return urls[rank::world_size]

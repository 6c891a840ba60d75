"""The trainer's weights to vLLM servers through vLLM's own weight-transfer engines (GPUs).

``vllm_server`` ships each weight version one of three ways (``sampler.engine.weight_transfer``):

- ``file``: a safetensors snapshot the server reloads (:mod:`gspo_lightning.engines.weight_snapshots`); works
  everywhere, CPUs included, and costs a write and a read through host memory per version;
- ``nccl``: vLLM's NCCL broadcast (``vllm.distributed.weight_transfer``): the trainer's rank that feeds a server
  opens an NCCL group with that server's workers and broadcasts the full tensors, GPU to GPU, across nodes too.
  NCCL refuses two ranks on one GPU, so a server on the trainer's own GPU needs ``ipc``;
- ``ipc``: vLLM's CUDA IPC engine: the server maps the trainer's GPU tensors (same GPU, no copy through the host).
  Its handles travel pickled over HTTP, which the server accepts only with
  ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``: for servers on this machine, on 127.0.0.1.

``auto`` is ``nccl`` when the trainer runs on CUDA GPUs, else ``file``. vLLM drives the handshake
(``/init_weight_transfer_engine`` once; ``/start_weight_update``, ``/update_weights`` and
``/finish_weight_update`` per version) through its own HTTP client; this module only says which engine, which
tensors and where the NCCL rendezvous is. The versions sent are copies the trainer took at the version's step
(``WeightSnapshots.take(in_memory=True)``), so an update on the sampling thread never reads parameters the
optimizer is changing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import Tensor

from gspo_lightning.validation import SettingError, require, require_one_of

WeightTransfer = Literal["auto", "file", "nccl", "ipc"]
TRANSFERS = ("auto", "file", "nccl", "ipc")


def resolve_transfer(choice: str, device: torch.device) -> str:
    """``choice`` (``sampler.engine.weight_transfer``) for a trainer on ``device``: ``auto`` resolved, and the GPU
    engines refused on anything but CUDA."""
    require_one_of("sampler.engine.weight_transfer", choice, TRANSFERS)
    if choice == "auto":
        return "nccl" if device.type == "cuda" else "file"
    require(choice == "file" or device.type == "cuda",
            f"sampler.engine.weight_transfer: {choice} needs the trainer on CUDA GPUs (it is on {device.type}); "
            "use file (or auto)")  # fmt: skip
    return choice


def server_flags(transfer: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The ``vllm serve`` arguments and environment a server the engine starts needs for ``transfer``."""
    if transfer == "file":
        return {}, {}
    variables = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"} if transfer == "ipc" else {}
    return {"weight_transfer_config": '{"backend": "%s"}' % transfer}, variables


def server_workers(info: dict[str, Any], transfer: str, url: str) -> int:
    """How many workers of the server whose ``/server_info?config_format=json`` is ``info`` receive the weights
    (its tensor x pipeline x data parallel size); refuses a server started without ``transfer``'s engine."""
    config = info.get("vllm_config") or {}
    backend = (config.get("weight_transfer_config") or {}).get("backend")
    if backend != transfer:
        raise SettingError(f"vLLM server {url} has weight transfer {backend!r}, sampler.engine.weight_transfer is "
                           f"{transfer!r}: start it with --weight-transfer-config '{{\"backend\": \"{transfer}\"}}'")
    parallel = config.get("parallel_config") or {}
    sizes = (parallel.get(key) or 1 for key in ("tensor_parallel_size", "pipeline_parallel_size",
                                                "data_parallel_size"))  # fmt: skip
    workers = 1
    for size in sizes:
        workers *= int(size)
    return workers


def weight_source(tensors: dict[str, Tensor]) -> Any:
    """A ``vllm`` ``WeightSource`` over a version's full tensors (metadata and tensors in one order)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class VersionSource(WeightSource):
        def __init__(self) -> None:
            self.tensors = tensors

        def metadata(self) -> list[Any]:
            return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.tensors.items()]

        def __iter__(self) -> Iterator[tuple[str, Tensor]]:
            return iter(self.tensors.items())

    return VersionSource()


class TransferLink:
    """One server's end of a vLLM weight-transfer engine, opened once at fit start.

    Args:
        transfer: ``nccl`` or ``ipc``.
        url: the server's base URL.
        first: the first version's tensors (their names, dtypes and shapes must stay those of every later one).
        workers: the server's receiving workers (``server_workers``).
        address, port: the NCCL rendezvous (a TCP store on this process), reachable from the server.
        timeout: seconds one control request may take.
    """

    def __init__(self, transfer: str, url: str, first: dict[str, Tensor], workers: int, address: str, port: int,
                 timeout: float) -> None:  # fmt: skip
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        self.source = weight_source(first)
        if transfer == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            info: Any = NCCLTrainerInitInfo(master_address=address, master_port=port, world_size=1 + workers, rank=0)
        else:
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            info = IPCTrainerInitInfo(rank=0)
        client = HTTPVLLMWeightSyncClient(url, timeout=timeout)
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=self.source)

    def send(self, tensors: dict[str, Tensor]) -> None:
        """The server's workers receive ``tensors`` (vLLM's start, update and finish round trip)."""
        self.source.tensors = tensors
        self.engine.send_weights()

    def close(self) -> None:
        try:
            self.engine.shutdown()
        except Exception:  # noqa: BLE001 - teardown after a failed run must not hide its error
            pass

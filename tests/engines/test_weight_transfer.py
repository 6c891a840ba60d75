"""vllm_server's weight transfer through vLLM's own engines: the choice, the servers' flags and checks, the tensors
handed to vLLM, and a sync's order against a fake server. NCCL and CUDA IPC themselves need GPUs: their transfer
is measured by ``experiments/gpu/run.py``."""

from __future__ import annotations

import pytest
import torch

from gspo_lightning.engines.server_client import Servers
from gspo_lightning.engines.vllm_server import VLLMServerEngine
from gspo_lightning.engines.weight_snapshots import PROBE_LENGTH, WeightSnapshot
from gspo_lightning.engines.weight_transfer import (
    TransferLink,
    resolve_transfer,
    server_flags,
    server_workers,
    weight_source,
)
from tests.engines.fake_vllm_server import Behaviour, FakeVLLMServer

pytest.importorskip("vllm")

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


def test_auto_is_nccl_on_gpus_and_files_on_cpus():
    assert resolve_transfer("auto", GPU) == "nccl"
    assert resolve_transfer("auto", CPU) == "file"
    assert resolve_transfer("ipc", GPU) == "ipc"


@pytest.mark.parametrize("choice", ["nccl", "ipc"])
def test_a_gpu_transfer_on_a_cpu_trainer_is_refused_naming_the_setting(choice):
    with pytest.raises(ValueError, match=f"sampler.engine.weight_transfer: {choice} needs the trainer on CUDA GPUs"):
        resolve_transfer(choice, CPU)


def test_an_unknown_transfer_is_refused_listing_the_choices():
    with pytest.raises(ValueError, match="sampler.engine.weight_transfer.*'auto', 'file', 'nccl', 'ipc'"):
        VLLMServerEngine(urls=["http://node7:8000"], weight_transfer="rdma")


def test_started_servers_get_the_transfer_engine_and_ipc_its_serialization():
    assert server_flags("file") == ({}, {})
    assert server_flags("nccl") == ({"weight_transfer_config": '{"backend": "nccl"}'}, {})
    arguments, variables = server_flags("ipc")
    assert arguments == {"weight_transfer_config": '{"backend": "ipc"}'}
    assert variables == {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def test_a_servers_workers_are_its_parallel_sizes_and_another_transfer_is_refused_naming_both():
    config = {"weight_transfer_config": {"backend": "nccl"},
              "parallel_config": {"tensor_parallel_size": 2, "pipeline_parallel_size": 1, "data_parallel_size": 2}}
    assert server_workers({"vllm_config": config}, "nccl", "http://node7:8000") == 4
    with pytest.raises(ValueError, match=r"http://node7:8000 has weight transfer None, .* is 'nccl': start it with "
                                         r"--weight-transfer-config '\{\"backend\": \"nccl\"\}'"):  # fmt: skip
        server_workers({"vllm_config": {}}, "nccl", "http://node7:8000")


def test_the_source_declares_what_it_yields_in_vllms_layer_groups():
    tensors = {"model.embed_tokens.weight": torch.ones(4, 2, dtype=torch.bfloat16),
               "model.layers.0.mlp.up_proj.weight": torch.zeros(3, 2),
               "model.layers.1.mlp.up_proj.weight": torch.zeros(3, 2)}  # fmt: skip
    source = weight_source(tensors)
    meta = source.metadata()
    assert [(m.name, m.dtype, m.shape) for m in meta] == [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    grouped = [name for names, _ in source.iter_groups() for name in names]  # vLLM checks order against metadata
    assert sorted(grouped) == sorted(tensors)
    source.tensors = {name: tensor + 1 for name, tensor in tensors.items()}  # the next version, same layout
    assert all(float(tensor.float().min()) >= 1 for _, tensor in source)


def test_an_nccl_link_rendezvous_with_the_servers_workers_as_rank_0(monkeypatch):
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    seen = {}

    def trainer_init(info, *, client, source):
        seen.update(info=info, url=client.base_url, names=[m.name for m in source.metadata()])
        return "engine"

    monkeypatch.setattr(WeightTransferTrainerFactory, "trainer_init", trainer_init)
    TransferLink("nccl", "http://node7:8000/", {"w": torch.ones(2)}, workers=2, address="10.0.0.1", port=29705,
                 timeout=5)  # fmt: skip
    info = seen["info"]
    assert (info.backend, info.master_address, info.master_port, info.world_size, info.rank) == \
        ("nccl", "10.0.0.1", 29705, 3, 0)  # fmt: skip
    assert seen["url"] == "http://node7:8000" and seen["names"] == ["w"]


class RecordingLink:
    def __init__(self, fake: FakeVLLMServer) -> None:
        self.fake = fake

    def send(self, tensors):
        self.fake.behaviour.requests.append(("send", sorted(tensors)))

    def close(self):
        pass


@pytest.fixture
def engine_on_fake():
    fake = FakeVLLMServer(Behaviour())
    engine = VLLMServerEngine(urls=[fake.url], retry_seconds=0.3, weight_transfer="nccl")
    engine.client = Servers([fake.url], 5, 0.3, "policy")
    engine.snapshots.probe = torch.arange(PROBE_LENGTH)
    engine.links = [RecordingLink(fake)]
    yield engine, fake
    fake.stop()


def _version(step: int, probe: float) -> WeightSnapshot:
    return WeightSnapshot(step, None, torch.full((PROBE_LENGTH - 1,), probe), 8, {"w": torch.ones(2)})


def test_an_in_memory_version_is_sent_while_paused_then_the_cache_reset_and_the_probe_checked(engine_on_fake):
    engine, fake = engine_on_fake
    engine.load_snapshot(_version(3, -0.5))  # the fake server's probe log-probs are -0.5
    assert fake.paths() == ["/pause?mode=wait", "send", "/reset_prefix_cache", "/resume", "/v1/completions"]
    assert engine.synced_step == 3 and engine.take_figures()["sync_bytes"] == 8


def test_a_sent_version_the_server_does_not_hold_stops_the_run(engine_on_fake):
    engine, fake = engine_on_fake
    with pytest.raises(RuntimeError, match="weight sync check failed at step 4: the vLLM server http://127"):
        engine.load_snapshot(_version(4, -2.0))
    assert engine.loaded is None


def test_an_in_memory_version_holds_the_files_tensors_in_the_engines_dtype_and_the_same_probe(policy, tokenizer):
    from contextlib import nullcontext
    from types import SimpleNamespace

    from safetensors.torch import load_file

    from gspo_lightning.engines.weight_snapshots import WeightSnapshots

    snapshots = WeightSnapshots(None, None)
    plugin = SimpleNamespace(forward_context=nullcontext)
    trainer = SimpleNamespace(global_step=5, strategy=None, precision_plugin=plugin)
    module = SimpleNamespace(policy=policy, tokenizer=tokenizer, device=CPU)
    snapshots.setup(trainer, module, "bfloat16")
    written, held = snapshots.take(trainer, module), snapshots.take(trainer, module, in_memory=True)
    try:
        on_disk = load_file(f"{written.path}/model.safetensors")
        assert held.path is None and sorted(held.tensors) == sorted(on_disk)
        assert all(t.dtype == torch.bfloat16 for t in held.tensors.values())
        assert all(torch.equal(held.tensors[n], on_disk[n].to(torch.bfloat16)) for n in on_disk)
        assert held.nbytes * 2 == written.nbytes  # float32 written, bfloat16 held
        assert torch.equal(held.probe_logprobs, written.probe_logprobs) and held.step == 5
        with torch.no_grad():
            next(policy.parameters()).add_(1.0)  # the optimizer moves on: the version held does not
        assert not torch.equal(held.tensors["model.embed_tokens.weight"].float(), policy.model.embed_tokens.weight)
    finally:
        snapshots.close()

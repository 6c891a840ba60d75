"""A LoRA policy synced as its adapter alone (``sampler.engine.lora_sync``): the base and the adapter apart, the
adapter written as peft writes it, which policies and servers vLLM can serve that way, and the load / probe /
unload order against fake servers. The real ``vllm serve`` runs in ``test_vllm_server_cli.py`` (slow)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gspo_lightning.engines import VLLMServerEngine
from gspo_lightning.engines.base import SamplingSettings
from gspo_lightning.engines.lora_adapters import adapter_refusal, check_server_lora, max_lora_rank
from gspo_lightning.engines.lora_adapters import resolve_lora_sync, write_adapter
from gspo_lightning.engines.server_client import Servers
from gspo_lightning.engines.weight_snapshots import PROBE_LENGTH, WeightSnapshot
from gspo_lightning.engines.weight_sync import policy_state
from gspo_lightning.models import TinyQwen3
from tests.conftest import TINY
from tests.engines.fake_vllm_server import Behaviour, FakeVLLMServer

peft = pytest.importorskip("peft")
SETTINGS = SamplingSettings(max_new_tokens=3, temperature=1.0)
SETTINGS_INFO = {"vllm_config": {"lora_config": {"max_lora_rank": 8}},
                 "vllm_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": True}}  # fmt: skip


def _lora_policy(**config) -> torch.nn.Module:
    loader = TinyQwen3(**TINY)
    model = loader.load_model(loader.load_tokenizer())
    options = dict(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules="all-linear") | config
    policy = peft.get_peft_model(model, peft.LoraConfig(**options))
    with torch.no_grad():  # a trained adapter: B is zero at initialisation
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.3)
    return policy.eval()


def test_the_base_and_the_adapter_apart_make_the_merged_weights():
    policy = _lora_policy()
    base, adapter, merged = (policy_state(policy, lora=lora) for lora in ("base", "adapter", "merged"))
    assert base.keys() == merged.keys()
    ours = peft.get_peft_model_state_dict(policy)  # what peft's save_pretrained writes
    assert adapter.keys() == ours.keys() and all(torch.equal(adapter[n], t) for n, t in ours.items())
    prefix = "base_model.model.model.layers.1.mlp.up_proj"
    down, up = adapter[f"{prefix}.lora_A.weight"], adapter[f"{prefix}.lora_B.weight"]  # [r, in], [out, r]
    expected = base["model.layers.1.mlp.up_proj.weight"] + 8 / 4 * up @ down  # W + alpha / r * B @ A
    torch.testing.assert_close(merged["model.layers.1.mlp.up_proj.weight"], expected, rtol=0, atol=1e-6)
    assert not torch.equal(base["model.layers.1.mlp.up_proj.weight"], merged["model.layers.1.mlp.up_proj.weight"])


def test_the_written_adapter_loads_back_into_the_same_policy(tmp_path):
    policy = _lora_policy()
    write_adapter(str(tmp_path), policy, policy_state(policy, lora="adapter"))
    loader = TinyQwen3(**TINY)
    loaded = peft.PeftModel.from_pretrained(loader.load_model(loader.load_tokenizer()), str(tmp_path)).eval()
    ids = torch.randint(0, 20, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, policy(ids).logits, rtol=0, atol=1e-6)
        with policy.disable_adapter():
            assert (policy(ids).logits - loaded(ids).logits).abs().max() > 1e-2  # the adapter matters


@pytest.mark.parametrize(
    "config, reason",
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "also trains whole modules (modules_to_save"),
    ],
)
def test_what_vllm_cannot_apply_is_named(config, reason):
    assert reason in (adapter_refusal(_lora_policy(**config)) or "")


def test_a_plain_policy_or_a_trained_base_has_no_adapter_to_sync():
    loader = TinyQwen3(**TINY)
    assert "no LoRA adapter" in adapter_refusal(loader.load_model(loader.load_tokenizer()))
    policy = _lora_policy()
    policy.base_model.model.model.norm.weight.requires_grad_(True)
    assert "outside the adapter train too (base_model.model.model.norm.weight" in adapter_refusal(policy)
    assert adapter_refusal(_lora_policy()) is None


def test_lora_sync_resolves_to_the_adapter_only_where_it_can():
    lora, loader = _lora_policy(), TinyQwen3(**TINY)
    plain = loader.load_model(loader.load_tokenizer())
    assert resolve_lora_sync("auto", lora, "auto") and resolve_lora_sync("adapter", lora, "file")
    assert not resolve_lora_sync("auto", plain, "auto") and not resolve_lora_sync("merged", lora, "auto")
    assert not resolve_lora_sync("auto", lora, "nccl")  # the user asked for full weights over NCCL
    with pytest.raises(ValueError, match="lora_sync: adapter, but the policy has no LoRA adapter"):
        resolve_lora_sync("adapter", plain, "auto")
    with pytest.raises(ValueError, match="lora_sync: adapter loads adapters from files .* weight_transfer is ipc"):
        resolve_lora_sync("adapter", lora, "ipc")
    with pytest.raises(ValueError, match="sampler.engine.lora_sync must be one of"):
        VLLMServerEngine(urls=["http://a:1"], lora_sync="lora")


def test_the_servers_rank_is_the_smallest_vllm_accepts():
    assert [max_lora_rank(SimpleNamespace(r=r)) for r in (1, 8, 12, 64, 300)] == [1, 8, 16, 64, 320]
    assert max_lora_rank(SimpleNamespace(r=8, rank_pattern={"q_proj": 40})) == 64
    with pytest.raises(ValueError, match="LoRA rank 600 is over vLLM's largest"):
        max_lora_rank(SimpleNamespace(r=600))


@pytest.mark.parametrize(
    "info, message",
    [
        ({"vllm_config": {"lora_config": None}}, "has LoRA off.* --enable-lora --max-lora-rank 8"),
        ({"vllm_config": {"lora_config": {"max_lora_rank": 1}}}, "has --max-lora-rank 1, the policy's adapter rank 8"),
        ({**SETTINGS_INFO, "vllm_env": {}}, "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"),
    ],
)
def test_a_server_that_cannot_load_the_adapters_is_refused_at_fit_start(info, message):
    with pytest.raises(ValueError, match=message):
        check_server_lora(info, "http://node7:8000", _lora_policy())
    check_server_lora(SETTINGS_INFO, "http://node7:8000", _lora_policy())


def test_each_version_loads_under_a_new_name_is_probed_under_it_and_the_last_is_unloaded():
    fakes = [FakeVLLMServer(Behaviour()), FakeVLLMServer(Behaviour())]
    try:
        engine = VLLMServerEngine(urls=[fake.url for fake in fakes], retry_seconds=1)
        engine.client = Servers(engine.urls, 5, 1, "policy")
        engine.snapshots.probe = torch.arange(PROBE_LENGTH)
        expected = torch.full((PROBE_LENGTH - 1,), -0.5)  # what the fake servers answer
        for step in (1, 2):
            engine.load_snapshot(WeightSnapshot(step, f"/dev/shm/adapter_{step}", expected, lora="adapter"))
        for fake in fakes:
            calls = [(path, body) for path, body in fake.behaviour.requests if path != "/v1/models"]
            assert [path for path, _ in calls] == [
                "/pause?mode=wait", "/v1/load_lora_adapter", "/reset_prefix_cache", "/resume", "/v1/completions",
                "/pause?mode=wait", "/v1/load_lora_adapter", "/reset_prefix_cache", "/resume", "/v1/completions",
                "/v1/unload_lora_adapter",
            ]  # fmt: skip
            first, second = calls[1][1], calls[6][1]
            assert first["lora_path"] == "/dev/shm/adapter_1" and second["lora_path"] == "/dev/shm/adapter_2"
            assert first["lora_name"] != second["lora_name"] and first["lora_name"].startswith("policy-lora-")
            assert calls[4][1]["model"] == first["lora_name"] and calls[9][1]["model"] == second["lora_name"]
            assert calls[10][1] == {"lora_name": first["lora_name"]}
        assert engine.client.adapter == second["lora_name"]  # what rounds now sample with
        engine.sample(None, SimpleNamespace(pad_token_id=0), torch.tensor([[3, 4]]), torch.ones(1, 2), SETTINGS, 1)
        assert fakes[0].behaviour.requests[-1][1]["model"] == second["lora_name"]
    finally:
        for fake in fakes:
            fake.stop()


"""What an engine receives from the trainer: full weights under Hugging Face names, a layer at a time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gspo_lightning.engines.weight_sync import hf_name, policy_state, policy_weight_groups
from gspo_lightning.models import TinyQwen3
from tests.conftest import TINY


def _initial_state() -> dict[str, torch.Tensor]:
    loader = TinyQwen3(**TINY)
    return loader.load_model(loader.load_tokenizer()).state_dict()


def test_the_groups_are_the_checkpoints_weights_one_layer_at_a_time(policy):
    groups = list(policy_weight_groups(policy))
    assert len(groups) == TINY["num_layers"] + 1  # embeddings, final norm and head, then each decoder layer
    assert {name.split(".")[2] for name, _ in groups[1]} == {"0"} and {n.split(".")[2] for n, _ in groups[2]} == {"1"}
    state = policy_state(policy)
    assert state.keys() == policy.state_dict().keys()  # the tied head too, under its own name
    for name, tensor in policy.state_dict().items():
        assert torch.equal(state[name], tensor), name


def test_wrapper_names_are_removed():
    assert hf_name("_fsdp_wrapped_module.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight") == (
        "model.layers.0.mlp.up_proj.weight"
    )
    assert hf_name("base_model.model.model.layers.3.self_attn.q_proj.base_layer.weight") == (
        "model.layers.3.self_attn.q_proj.weight"
    )


def test_a_lora_adapter_is_merged_into_the_weights_the_engine_gets():
    pytest.importorskip("peft")
    from gspo_lightning.models import LoRA

    loader = LoRA(TinyQwen3(**TINY), r=4)
    model = loader.load_model(loader.load_tokenizer())
    with torch.no_grad():  # a trained adapter: B is zero at initialisation
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1)
    state = policy_state(model)
    merged = model.merge_and_unload().state_dict()  # peft's own merge, for reference
    assert state.keys() == merged.keys()
    for name, tensor in merged.items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "fsdp1"])
def test_every_rank_gathers_the_full_weights_one_layer_at_a_time(tmp_path, strategy):
    script = Path(__file__).with_name("weight_sync_ranks.py")
    command = [sys.executable, str(script), "--strategy", strategy, "--out", str(tmp_path / "weights")]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    initial = _initial_state()
    layer = sum(t.numel() for n, t in initial.items() if n.startswith("model.layers.0."))
    rest = sum(t.numel() for n, t in initial.items() if not n.startswith("model.layers."))
    for rank in (0, 1):
        saved = torch.load(tmp_path / f"weights.rank{rank}.pt")
        assert saved["weights"].keys() == initial.keys()
        for name, tensor in initial.items():
            assert torch.equal(saved["weights"][name], tensor), (rank, name)
        assert saved["largest"] <= max(layer, rest)  # never the whole model at once


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "fsdp1"])
def test_every_rank_gathers_a_lora_policys_base_adapter_and_merged_weights(tmp_path, strategy):
    """What adapter sync sends (``lora_sync``), gathered from shards: the adapter as peft saves it and the base,
    which make the merged weights; the same on both ranks, after a step moved the adapter."""
    script = Path(__file__).with_name("weight_sync_ranks.py")
    command = [sys.executable, str(script), "--strategy", strategy, "--out", str(tmp_path / "weights"), "--lora"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    first, second = (torch.load(tmp_path / f"weights.rank{rank}.pt") for rank in (0, 1))
    for kind in ("merged", "base", "adapter"):
        assert first[kind].keys() == second[kind].keys()
        assert all(torch.equal(first[kind][name], second[kind][name]) for name in first[kind]), kind
    merged, base, adapter = first["merged"], first["base"], first["adapter"]
    assert base.keys() == merged.keys() == _initial_state().keys()
    for name, tensor in _initial_state().items():
        assert torch.equal(base[name], tensor), name  # the frozen base is the checkpoint's
    modules = {name.rsplit(".lora_", 1)[0] for name in adapter}
    assert len(modules) == 7 * TINY["num_layers"]  # every linear layer of every decoder layer
    for module in modules:
        down, up = adapter[f"{module}.lora_A.weight"], adapter[f"{module}.lora_B.weight"]  # [r, in], [out, r]
        weight = module.removeprefix("base_model.model.") + ".weight"
        assert up.abs().max() > 0  # the step moved B away from its zero start
        torch.testing.assert_close(merged[weight], base[weight] + 8 / 4 * up @ down, rtol=0, atol=1e-6)

"""Data-parallel strategies on CPU (gloo, 2 processes): one optimizer step equals the single-process step on the
same global batch (gradients averaged, clipped by the global norm), and a sharded policy exports whole."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from gspo_lightning.strategies import DecoderLayerFSDP, DecoderLayerFSDP2, decoder_layer_classes
from tests.conftest import TINY

SCRIPT = Path(__file__).with_name("one_step.py")
CLIP = 0.01  # well below the gradient norm: clipping changes the step, so a per-shard norm would show


MODULE_OPTIONS = {"module_checkpointing": ["--module-checkpointing"], "packing": ["--packing"],
                  "micro_batches": ["--micro-batch-tokens", "12"]}  # fmt: skip


def one_step(directory: Path, strategy: str, devices: int, export: bool = False) -> dict[str, torch.Tensor]:
    """``strategy`` is one of one_step.py's, optionally with ``+option`` for module options (``MODULE_OPTIONS``:
    ``+module_checkpointing``, ``+packing``, ``+micro_batches``: 12 tokens, one or two sequences each)."""
    out = directory / f"{strategy}.pt"
    name, *module_options = strategy.split("+")
    command = [sys.executable, str(SCRIPT), "--strategy", name, "--devices", str(devices), "--clip", str(CLIP)]
    command += [argument for option in module_options for argument in MODULE_OPTIONS[option]]
    command += ["--out", str(out)] + (["--export", str(directory / f"{strategy}_hf")] if export else [])
    result = subprocess.run(command, capture_output=True, text=True, cwd=directory, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory) -> dict[str, torch.Tensor]:
    return one_step(tmp_path_factory.mktemp("single"), "single", devices=1)


@pytest.fixture(scope="module")
def initial() -> dict[str, torch.Tensor]:
    from gspo_lightning.models import TinyQwen3

    loader = TinyQwen3(**TINY)
    return loader.load_model(loader.load_tokenizer()).state_dict()


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy",
    ["ddp", "fsdp2", "fsdp1", "fsdp2_checkpointing", "fsdp1_checkpointing"]
    + [f"{name}+module_checkpointing" for name in ("ddp", "fsdp2", "fsdp1")]  # model.activation_checkpointing
    + ["ddp+packing+micro_batches", "fsdp1+packing"],  # fsdp1: the fit-start probe runs with the root gathered
)
def test_two_rank_step_equals_the_single_process_step(tmp_path, strategy, single_process, initial):
    two_ranks = one_step(tmp_path, strategy, devices=2, export=True)
    assert two_ranks.keys() == single_process.keys()
    for name, expected in single_process.items():
        step, two_rank_step = expected - initial[name], two_ranks[name] - initial[name]
        torch.testing.assert_close(two_rank_step, step, rtol=1e-5, atol=1e-7, msg=name)
    assert max((single_process[n] - initial[n]).abs().max() for n in initial) > 1e-5  # the step did move
    # The export (gathered to rank 0 under FSDP) loads with from_pretrained and holds exactly the trained weights.
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / f"{strategy}_hf").state_dict()
    for name, value in two_ranks.items():
        assert torch.equal(exported[name], value), name


def test_decoder_layers_are_found_from_the_model(policy):
    assert {cls.__name__ for cls in decoder_layer_classes(policy)} == {"Qwen3DecoderLayer"}
    with pytest.raises(ValueError, match="cannot find the decoder layers"):
        decoder_layer_classes(torch.nn.Linear(2, 2))


def test_strategies_take_their_options():
    fsdp1 = DecoderLayerFSDP(activation_checkpointing=True, sharding_strategy="SHARD_GRAD_OP")
    assert fsdp1.activation_checkpointing and fsdp1.kwargs["use_orig_params"] is True
    fsdp2 = DecoderLayerFSDP2(reshard_after_forward=False)
    assert fsdp2._tensor_parallel_size == 1 and not fsdp2.reshard_after_forward


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("strategy", ["fsdp1", "fsdp2"])
def test_gpu_sharded_step_runs_in_bf16(tmp_path, strategy):
    """On a GPU machine: the FSDP strategies train one bf16-mixed step through the CLI's tiny config."""
    from tests.test_cli import tiny_run_config

    config = tiny_run_config(tmp_path, max_steps=2)
    classes = {"fsdp1": "DecoderLayerFSDP", "fsdp2": "DecoderLayerFSDP2"}
    command = [
        sys.executable, "-m", "gspo_lightning", "fit", "-c", str(config),
        "--trainer.accelerator=gpu", "--trainer.devices=1", "--trainer.precision=bf16-mixed",
        f'--trainer.strategy={{"class_path": "gspo_lightning.strategies.{classes[strategy]}"}}',
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["DecoderLayerFSDP", "DecoderLayerFSDP2"])
def test_lora_trains_and_exports_its_adapter_under_fsdp(tmp_path, strategy):
    peft = pytest.importorskip("peft")
    import json
    import os

    from tests.test_cli import ROOT, tiny_run_config

    extra = {"sampler": {"rewards": ["tests.fault_helpers.length_reward"]}}
    config = tiny_run_config(tmp_path, max_steps=2, checkpoint_every=2, extra=extra)
    base = {"class_path": "gspo_lightning.models.TinyQwen3", "init_args": TINY}
    lora = {"class_path": "gspo_lightning.models.LoRA", "init_args": {"base": base, "r": 4}}
    command = [
        sys.executable, "-m", "gspo_lightning", "fit", "-c", str(config), "--trainer.devices=2",
        "--trainer.strategy=" + json.dumps({"class_path": f"gspo_lightning.strategies.{strategy}"}),
        "--model.init_args.policy=" + json.dumps(lora),
    ]  # fmt: skip
    environment = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=environment, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    export = tmp_path / "runs/tiny/version_0/hf_policy"
    assert (export / "adapter_config.json").exists() and not (export / "model.safetensors").exists()
    from gspo_lightning.models import TinyQwen3

    loader = TinyQwen3(**TINY)
    adapted = peft.PeftModel.from_pretrained(loader.load_model(loader.load_tokenizer()), export)
    trained = [p for n, p in adapted.named_parameters() if "lora_B" in n]
    assert trained and any(p.abs().max() > 0 for p in trained)  # lora_B starts at 0: the adapter learned


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "fsdp1"])
def test_a_nan_loss_on_one_rank_skips_the_step_on_every_rank(tmp_path, strategy):
    """Only rank 1's minibatch gives a NaN loss at step 1: both ranks skip it together (no hang, no divergence)."""
    import json

    script = SCRIPT.with_name("nonfinite_rank.py")
    command = [sys.executable, str(script), "--strategy", strategy, "--out", str(tmp_path / "sums")]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"sums.rank{r}.json").read_text())["sums"] for r in (0, 1)]
    for sums in ranks if strategy == "ddp" else ranks[:1]:  # sharded: rank 0 holds the gathered weights
        assert len(sums) == 3 and sums[1] == sums[0] and sums[2] != sums[1]  # step 1 skipped, step 2 trained
    if strategy == "ddp":
        assert ranks[0] == ranks[1]  # the replicas stayed equal


def test_module_checkpointing_under_a_plain_fsdp1_strategy_says_what_to_use(policy):
    from lightning.pytorch.strategies import FSDPStrategy

    from gspo_lightning.strategies import shard_for_strategy

    with pytest.raises(ValueError, match="use gspo_lightning.DecoderLayerFSDP"):
        shard_for_strategy(policy, FSDPStrategy(), None, activation_checkpointing=True)
    strategy = DecoderLayerFSDP()
    shard_for_strategy(policy, strategy, None, activation_checkpointing=True)
    assert strategy.activation_checkpointing  # applied when the strategy wraps the model




@pytest.mark.slow
def test_a_finished_two_rank_run_exits_cleanly_although_gloo_threads_race_the_exit():
    # With a bare destroy_process_group ("destroy_only") this harness aborted 4 runs in 20 (exit -6), and 2 in 10
    # once it loaded the ending alone (6 s a run, not 25): 8 clean exits in a row would pass by chance about 1
    # time in 6.
    command = [sys.executable, str(Path(__file__).with_name("exit_race.py")), "close_process_group"]
    for attempt in range(8):
        result = subprocess.run(command, capture_output=True, text=True, timeout=240)
        assert result.returncode == 0, f"attempt {attempt}: {result.stdout[-300:]}\n{result.stderr[-2000:]}"


@pytest.mark.parametrize("strategy", [DecoderLayerFSDP, DecoderLayerFSDP2])
def test_micro_batches_under_fsdp_are_refused_naming_the_setting(strategy):
    from gspo_lightning.strategies import refuse_micro_batches_sharded
    from gspo_lightning.validation import SettingError

    refuse_micro_batches_sharded(None, strategy())
    refuse_micro_batches_sharded(512, "ddp")
    with pytest.raises(SettingError, match=f"model.micro_batch_tokens=512 is not supported under {strategy.__name__}"):
        refuse_micro_batches_sharded(512, strategy())

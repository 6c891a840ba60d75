"""``configs/slurm/servers.sbatch`` run against stand-ins for SLURM's commands (``scontrol``, ``srun``) and ``curl``:
the nodes it splits into trainers and servers, the servers it starts, and the trainer command, loaded through the
CLI as the trainer ranks would load it."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from gspo_lightning.cli import main
from gspo_lightning.engines import VLLMServerEngine
from gspo_lightning.sampling import GroupSampler
from tests.test_cli import ROOT, offline_overrides

SCRIPT = ROOT / "configs/slurm/servers.sbatch"
STUBS = {
    "scontrol": 'printf "n1\\nn2\\nn3\\nn4\\n"',
    # one write per call: the calls made in the background would otherwise interleave
    "srun": 'line=$(printf "%q " "$@"); echo "$line" >> "$CALLS"',
    "curl": "exit 0",
}


def _run_script(tmp_path: Path, **variables: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STUBS.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls.txt"
    environment = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", CALLS=str(calls),
                       SLURM_JOB_NODELIST="n[1-4]", GPUS_PER_NODE="2", **variables)  # fmt: skip
    result = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=environment, capture_output=True, text=True,
                            timeout=60)  # fmt: skip
    return result, [shlex.split(line) for line in _settled_lines(calls)]


def _settled_lines(calls: Path, quiet_s: float = 1.0, limit_s: float = 20.0) -> list[str]:
    """The calls once the stand-ins started in the background (the servers' ``srun ... &``, which the script does
    not wait for) have written theirs: the file unchanged for ``quiet_s``."""
    import time

    deadline, last, since = time.monotonic() + limit_s, None, time.monotonic()
    while time.monotonic() < deadline:
        text = calls.read_text() if calls.exists() else ""
        if text != last:
            last, since = text, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
        time.sleep(0.1)
    return (last or "").splitlines()


def _engine(cli) -> object:
    return next(c for c in cli.trainer.callbacks if isinstance(c, GroupSampler)).engine


def test_the_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_the_script_starts_a_server_per_inference_gpu_and_gives_the_trainers_their_urls(tmp_path, monkeypatch,
                                                                                         tiny_pretrained_dir):  # fmt: skip
    result, calls = _run_script(tmp_path)
    assert result.returncode == 0, result.stderr
    servers = [call for call in calls if "bash" in call]
    # the servers start in the background, so their stand-ins write in whichever order they run
    assert sorted(call[call.index("-w") + 1] for call in servers) == ["n3", "n4"]
    assert "vllm serve" in servers[0][-1] and "VLLM_SERVER_DEV_MODE=1" in servers[0][-1]
    assert "--logprobs-mode processed_logprobs" in servers[0][-1]
    (trainer,) = [call for call in calls if "gspo_lightning" in call]
    assert trainer[trainer.index("-w") + 1] == "n1,n2"
    fit = trainer[trainer.index("fit"):]
    urls = json.loads(next(a for a in fit if a.startswith("--sampler.engine.init_args.urls=")).split("=", 1)[1])
    assert urls == ["http://n3:8000", "http://n3:8001", "http://n4:8000", "http://n4:8001"]
    # what every trainer rank loads: the config with the script's overrides (offline here)
    monkeypatch.chdir(tmp_path)
    config = ROOT / fit[fit.index("-c") + 1]  # the script runs from the repository's root
    arguments = [str(config) if a == fit[fit.index("-c") + 1] else a for a in fit[1:]]
    engine = _engine(main([*arguments, *offline_overrides(config, tiny_pretrained_dir)], run=False))
    assert isinstance(engine, VLLMServerEngine) and engine.urls == urls
    assert engine.snapshots.directory == str(tmp_path / "weight_snapshots")


def test_too_few_inference_nodes_stop_before_anything_starts(tmp_path):
    result, calls = _run_script(tmp_path, TRAIN_NODES="3")
    assert result.returncode == 2 and calls == []
    assert "1 inference nodes for 3 trainer nodes: every training rank needs as many" in result.stderr


@pytest.mark.parametrize("config", ["configs/qwen3_0.6b_gsm8k_servers.yaml"])
def test_the_one_node_server_config_names_a_server_per_gpu(config, tmp_path, monkeypatch, tiny_pretrained_dir):
    monkeypatch.chdir(tmp_path)
    path = ROOT / config
    cli = main(["-c", str(path), *offline_overrides(path, tiny_pretrained_dir)], run=False)
    engine = _engine(cli)
    assert isinstance(engine, VLLMServerEngine) and (engine.servers, engine.devices) == (3, ["1", "2", "3"])

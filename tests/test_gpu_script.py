"""The GPU scripts (``experiments/gpu_engines/run.py``, ``experiments/gpu_moe_r3/run.py``) cannot run here: their
every command must at least parse."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "script, variants",
    [("gpu_engines", ["vllm_sleep", "server_ipc", "server_nccl"]),
     ("gpu_moe_r3", ["vllm_off", "vllm_r3", "server_r3"])],
)
def test_every_variant_of_the_gpu_scripts_parses_through_the_cli(script, variants):
    result = subprocess.run([sys.executable, str(ROOT / f"experiments/{script}/run.py"), "--check"],
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert [line.split(":")[0] for line in result.stdout.splitlines() if ": " in line] == variants

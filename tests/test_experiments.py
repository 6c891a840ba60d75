"""The experiments' shared helpers: per-step metrics, the training clock, seed bands; every script parses."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

from common import band, per_step, smooth, training_clock  # noqa: E402


def test_per_step_merges_the_rows_the_csv_logger_writes_for_one_step(tmp_path):
    metrics = tmp_path / "metrics.csv"
    metrics.write_text(
        "step,train/loss,time/generate_s,time/train_s,eval/accuracy\n"
        "0,,,,0.25\n0,0.5,1.0,0.5,\n1,0.25,,0.25,\n"
    )
    steps = per_step(metrics)
    assert steps == {0: {"train/loss": 0.5, "time/generate_s": 1.0, "time/train_s": 0.5, "eval/accuracy": 0.25},
                     1: {"train/loss": 0.25, "time/train_s": 0.25}}  # fmt: skip
    assert training_clock(steps) == {0: 1.5, 1: 1.75}


def test_band_and_smooth():
    xs, mean, low, high = band([([0, 10], [1.0, 3.0]), ([0, 12, 20], [3.0, 5.0, 9.0])])
    assert (xs, mean, low, high) == ([0, 11], [2.0, 4.0], [1.0, 3.0], [3.0, 5.0])
    assert smooth([1.0, math.nan, 3.0], window=2) == [1.0, 1.0, 3.0]


@pytest.mark.parametrize("script", sorted(ROOT.glob("experiments/*/run.py")), ids=lambda p: p.parent.name)
def test_every_experiment_script_documents_its_command(script):
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"python experiments/{script.parent.name}/run.py" in result.stdout

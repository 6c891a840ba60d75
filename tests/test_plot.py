"""``python -m gspo_lightning plot``: reads what the CSV logger wrote and draws every panel."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_lightning.plot import PANELS, main, metrics_file, panel_series, read_metrics, run_label, smooth

ROOT = Path(__file__).resolve().parents[1]


def write_run(directory: Path, steps: int, scale: float = 1.0) -> Path:
    """A metrics.csv as the CSV logger writes it: one row per logging call, empty cells for what it lacks."""
    names = ["epoch", "step", "rollout/reward_mean", "train/clip_frac", "train/entropy", "eval/accuracy",
             "diag/seq_ratio_p05", "diag/seq_ratio_p50", "diag/seq_ratio_p95",
             "drift/kl_old_theta_mb0", "drift/kl_old_theta_mb1", "lr-AdamW"]  # fmt: skip
    directory.mkdir(parents=True)
    with (directory / "metrics.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=names)
        writer.writeheader()
        for step in range(steps):
            writer.writerow({"epoch": 0, "step": step, "lr-AdamW": 1e-4})
            index = step % 2
            writer.writerow({
                "epoch": 0, "step": step, "rollout/reward_mean": scale * step / steps, "train/clip_frac": 0.1,
                "train/entropy": 1 - step / steps, "diag/seq_ratio_p05": 0.99, "diag/seq_ratio_p50": 1.0,
                "diag/seq_ratio_p95": 1.01, f"drift/kl_old_theta_mb{index}": 1e-3 * index,
                f"drift/kl_old_theta_mb{1 - index}": "nan",
            })  # fmt: skip
            if step % 10 == 0:
                writer.writerow({"epoch": 0, "step": step, "eval/accuracy": 0.2 + step / 1000})
    return directory


def test_metrics_are_read_per_step_without_the_empty_and_nan_cells(tmp_path):
    series = read_metrics(write_run(tmp_path / "run", steps=20))
    steps, rewards = series["rollout/reward_mean"]
    assert steps == list(range(20)) and rewards == pytest.approx([s / 20 for s in range(20)])
    assert series["eval/accuracy"][0] == [0, 10]
    assert series["drift/kl_old_theta_mb1"][0] == list(range(1, 20, 2))  # NaN at the other index's steps
    drift = panel_series(series, ("drift/kl_old_theta_mb*",))
    assert list(drift) == ["drift/kl_old_theta_mb0", "drift/kl_old_theta_mb1"]


def test_smoothing_is_a_trailing_mean_over_steps():
    assert smooth([0, 1, 2, 3], [1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert smooth([0, 1], [1.0, 3.0], 1) == [1.0, 3.0]
    # an evaluation every 100 steps is not averaged with the earlier ones by a 10-step window
    assert smooth([0, 100, 200], [0.2, 0.3, 0.4], 10) == [0.2, 0.3, 0.4]
    assert smooth([0, 1, 5, 6], [1.0, 3.0, 5.0, 7.0], 3) == [1.0, 2.0, 5.0, 6.0]


def test_the_newest_version_of_a_run_is_read(tmp_path):
    write_run(tmp_path / "quickstart/version_2", steps=3)
    write_run(tmp_path / "quickstart/version_10", steps=5)
    assert metrics_file(tmp_path / "quickstart") == tmp_path / "quickstart/version_10/metrics.csv"
    assert run_label(tmp_path / "quickstart/version_10") == "quickstart/version_10"


def test_two_runs_overlay_into_one_png_from_the_command_line(tmp_path):
    pytest.importorskip("matplotlib")
    first, second = write_run(tmp_path / "a", steps=40), write_run(tmp_path / "b", steps=30, scale=0.5)
    output = tmp_path / "both.png"
    command = [sys.executable, "-m", "gspo_lightning", "plot", str(first), str(second), "-o", str(output)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and output.stat().st_size > 20_000
    assert len(PANELS) == 6


def test_a_directory_without_metrics_is_named_in_the_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nowhere")])
    assert "nowhere: no metrics.csv" in capsys.readouterr().err

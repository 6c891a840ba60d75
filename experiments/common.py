"""Shared pieces of the experiments: run the CLI, read its per-step metrics, summarise seeds, draw bands.

Every experiment runs ``python -m gspo_lightning fit`` with command-line overrides in its own working directory,
so what is measured is exactly what a user runs.
"""

from __future__ import annotations

import csv
import math
import os
import platform
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs/quickstart.yaml"
STEP_TIMES = ("time/generate_s", "time/reward_s", "time/old_logprob_s", "time/train_s")


def seed_overrides(seed: int) -> list[str]:
    """The seed applied to the RL run, the warm start and the prompt stream (as the quick-start experiment)."""
    return [
        f"--seed_everything={seed}",
        f"--model.init_args.policy.init_args.seed={seed}",
        f"--data.init_args.seed={seed}",
    ]


def run_fit(workdir: Path, overrides: Sequence[str], cache: Path, config: Path = QUICKSTART) -> dict:
    """Run one training run; return its per-step metrics and wall-clock seconds."""
    workdir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "gspo_lightning", "fit", "-c", str(config), *overrides]
    command += ["--trainer.enable_progress_bar=false", "--trainer.logger.init_args.save_dir=runs"]
    environment = dict(os.environ, GSPO_LIGHTNING_CACHE=str(cache), PYTHONPATH=str(ROOT))
    started = time.perf_counter()
    result = subprocess.run(command, cwd=workdir, env=environment, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"run in {workdir} failed:\n{result.stderr[-4000:]}")
    metrics = next(workdir.glob("runs/*/version_0/metrics.csv"))
    return {"steps": per_step(metrics), "seconds": seconds}


def per_step(metrics_csv: Path) -> dict[int, dict[str, float]]:
    """Every logged value by step (the CSV logger writes several rows per step); empty cells skipped."""
    steps: dict[int, dict[str, float]] = defaultdict(dict)
    with metrics_csv.open() as handle:
        for row in csv.DictReader(handle):
            step = int(row["step"])
            for key, value in row.items():
                if key != "step" and value not in ("", None):
                    steps[step][key] = float(value)
    return dict(steps)


def training_clock(steps: dict[int, dict[str, float]]) -> dict[int, float]:
    """Cumulative seconds of sampling, scoring and training up to the end of each step (evaluations excluded)."""
    clock, total = {}, 0.0
    for step in sorted(steps):
        total += sum(steps[step].get(name, 0.0) for name in STEP_TIMES)
        clock[step] = total
    return clock


def series(steps: dict[int, dict[str, float]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) where ``key`` was logged."""
    pairs = [(step, values[key]) for step, values in sorted(steps.items()) if key in values]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average (NaNs ignored)."""
    out = []
    for index in range(len(values)):
        chunk = [v for v in values[max(0, index - window + 1) : index + 1] if not math.isnan(v)]
        out.append(sum(chunk) / len(chunk) if chunk else math.nan)
    return out


def band(curves: list[tuple[list[float], list[float]]]) -> tuple[list[float], list[float], list[float], list[float]]:
    """x, mean, min and max of curves sampled at the same points (e.g. the same evaluation steps); x is the mean
    over curves, so a time axis shows each point at its mean time. The shortest curve sets the length."""
    length = min(len(x) for x, _ in curves)
    xs = [sum(x[i] for x, _ in curves) / len(curves) for i in range(length)]
    columns = [[y[i] for _, y in curves] for i in range(length)]
    return xs, [sum(c) / len(c) for c in columns], [min(c) for c in columns], [max(c) for c in columns]


def plot_band(axis, curves, label: str, color: str) -> None:
    """Mean line with a min-max band over seeds."""
    xs, mean, low, high = band(curves)
    axis.plot(xs, mean, label=label, color=color)
    if len(curves) > 1:
        axis.fill_between(xs, low, high, color=color, alpha=0.2, linewidth=0)


def machine() -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, commit {commit.stdout.strip()}"


def write_csv(path: Path, rows: list[dict]) -> None:
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)

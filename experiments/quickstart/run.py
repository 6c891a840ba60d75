"""Measure the quick start from a cold cache, as a new user would run it, for several seeds.

    python experiments/quickstart/run.py --seeds 0 1 2

Each seed runs ``python -m gspo_lightning fit -c configs/quickstart.yaml`` in a fresh working directory with an
empty warm-start cache (so the supervised warm start is part of the time), with the seed applied to the RL run,
the warm start and the prompt stream. It records wall-clock time and held-out greedy accuracy at step 0 and
at the end, writes ``results.csv`` (one row per seed), ``curves.csv`` (held-out accuracy, reward and clip
fraction by step and seed) and ``health.csv`` (each run's means of the README's "a healthy run" figures) beside
this file, draws the first seed's run with ``python -m gspo_lightning plot``
into ``run.png`` (the README's picture) and prints a Markdown table. It exits non-zero if a run misses the floors:
at most 600 s, step-0 accuracy in [5%, 70%], a gain of at least 25 points.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).with_name("results.csv")
CURVES = Path(__file__).with_name("curves.csv")
PICTURE = Path(__file__).with_name("run.png")
CURVE_COLUMNS = ("eval/accuracy", "rollout/reward_mean", "train/clip_frac")
HEALTH = (
    "train/clip_frac", "diag/seq_ratio_p05", "diag/seq_ratio_p50", "diag/seq_ratio_p95", "diag/abs_log_seq_ratio_p95",
    "drift/kl_old_theta_mb0", "drift/kl_old_theta_mb1", "drift/kl_old_theta_mb2", "drift/kl_old_theta_mb3",
    "train/entropy", "rollout/zero_variance_frac",
)  # fmt: skip
"""The figures of the README's "a healthy run" column: their means over each run's steps (``health.csv``)."""
HEALTH_FILE = Path(__file__).with_name("health.csv")
FLOORS = {"max_seconds": 600.0, "min_start": 0.05, "max_start": 0.70, "min_gain": 0.25}


def _mean(rows: list[dict[str, str]], name: str, steps: range | None = None) -> float:
    values = [float(r[name]) for r in rows if r.get(name) and (steps is None or int(r["step"]) in steps)]
    return round(sum(values) / len(values), 6) if values else float("nan")


def run_seed(
    seed: int, workdir: Path, curves: list[dict[str, object]], health: list[dict[str, object]], picture: Path | None
) -> dict[str, object]:
    command = [
        sys.executable, "-m", "gspo_lightning", "fit", "-c", str(ROOT / "configs/quickstart.yaml"),
        f"--seed_everything={seed}",
        f"--model.init_args.policy.init_args.seed={seed}",
        f"--data.init_args.seed={seed}",
        "--trainer.enable_progress_bar=false",
    ]  # fmt: skip
    environment = dict(os.environ, GSPO_LIGHTNING_CACHE=str(workdir / "cache"))
    started = time.perf_counter()
    subprocess.run(command, cwd=workdir, env=environment, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - started
    metrics = workdir / "runs/quickstart/version_0/metrics.csv"
    rows = list(csv.DictReader(metrics.open()))
    curves += [{"seed": seed, "step": r["step"], **{c: r.get(c, "") for c in CURVE_COLUMNS}} for r in rows
               if any(r.get(c) for c in CURVE_COLUMNS)]  # fmt: skip
    if picture is not None:
        subprocess.run([sys.executable, "-m", "gspo_lightning", "plot", str(metrics.parent), "-o", str(picture)],
                       check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    health.append({
        "seed": seed, **{name: _mean(rows, name) for name in HEALTH},
        "train/entropy first 100": _mean(rows, "train/entropy", range(100)),
        "train/entropy last 100": _mean(rows, "train/entropy", range(1900, 2000)),
    })  # fmt: skip
    evaluations = [(int(r["step"]), float(r["eval/accuracy"])) for r in rows if r["eval/accuracy"]]
    (_, start), (last_step, end) = evaluations[0], evaluations[-1]
    return {
        "seed": seed, "seconds": round(seconds, 1), "steps": last_step, "accuracy_step0": start,
        "accuracy_end": end, "gain_points": round(100 * (end - start), 1),
    }  # fmt: skip


def meets_floors(row: dict[str, object]) -> bool:
    return (
        row["seconds"] <= FLOORS["max_seconds"]
        and FLOORS["min_start"] <= row["accuracy_step0"] <= FLOORS["max_start"]
        and row["accuracy_end"] - row["accuracy_step0"] >= FLOORS["min_gain"]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    rows: list[dict[str, object]] = []
    curves: list[dict[str, object]] = []
    health: list[dict[str, object]] = []
    for seed in args.seeds:
        with tempfile.TemporaryDirectory(prefix=f"quickstart-{seed}-") as workdir:
            row = run_seed(seed, Path(workdir), curves, health, PICTURE if seed == args.seeds[0] else None)
        row["meets_floors"] = meets_floors(row)
        rows.append(row)
        print(row, flush=True)
    for path, table in ((RESULTS, rows), (CURVES, curves), (HEALTH_FILE, health)):
        with path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(table[0]))
            writer.writeheader()
            writer.writerows(table)
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs\n")
    print("| seed | time (s) | steps | accuracy step 0 | accuracy end | gain (points) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['seed']} | {r['seconds']} | {r['steps']} | {r['accuracy_step0']:.1%} | {r['accuracy_end']:.1%} | {r['gain_points']:+} |")
    return 0 if all(r["meets_floors"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

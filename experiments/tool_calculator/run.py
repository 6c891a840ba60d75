"""Measure the tool-use demo from a cold cache, as a new user would run it, for several seeds.

    python experiments/tool_calculator/run.py --seeds 0 1 2

Each seed runs ``python -m gspo_lightning fit -c configs/tool_calculator.yaml`` in a fresh working directory with
an empty warm-start cache (the supervised warm start on transcripts is part of the time), the seed applied to the
RL run, the warm start and the prompt stream. It records the wall-clock time and, at step 0 and at the end, the
held-out greedy success (episodes whose final answer is the product) and the held-out calculator calls and turns
per episode; writes ``results.csv`` (one row per seed) and ``curves.csv`` (held-out success, tool calls, training
reward by step and seed) beside this file, and prints a Markdown table. It exits non-zero if a run misses the
floors: at most 600 s, a gain of at least 20 points, and more calculator calls per episode at the end.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from experiments.common import ROOT, run_fit, seed_overrides  # noqa: E402

CONFIG = ROOT / "configs/tool_calculator.yaml"
RESULTS = Path(__file__).with_name("results.csv")
CURVES = Path(__file__).with_name("curves.csv")
CURVE_COLUMNS = ("eval/accuracy", "eval/tool_calls_mean", "eval/turns_mean", "rollout/reward_mean",
                 "rollout/tool_calls_mean", "train/clip_frac")  # fmt: skip
FLOORS = {"max_seconds": 600.0, "min_gain": 0.20}


def run_seed(seed: int, workdir: Path, curves: list[dict[str, object]]) -> dict[str, object]:
    result = run_fit(workdir, seed_overrides(seed), workdir / "cache", config=CONFIG)
    steps = result["steps"]
    curves += [{"seed": seed, "step": step, **{c: row.get(c, "") for c in CURVE_COLUMNS}}
               for step, row in sorted(steps.items()) if any(c in row for c in CURVE_COLUMNS)]  # fmt: skip
    evaluations = [(step, row) for step, row in sorted(steps.items()) if "eval/accuracy" in row]
    (_, first), (last_step, last) = evaluations[0], evaluations[-1]
    return {
        "seed": seed, "seconds": round(result["seconds"], 1), "steps": last_step,
        "success_step0": first["eval/accuracy"], "success_end": last["eval/accuracy"],
        "gain_points": round(100 * (last["eval/accuracy"] - first["eval/accuracy"]), 1),
        "tool_calls_step0": first["eval/tool_calls_mean"], "tool_calls_end": last["eval/tool_calls_mean"],
        "turns_step0": first["eval/turns_mean"], "turns_end": last["eval/turns_mean"],
    }  # fmt: skip


def meets_floors(row: dict[str, object]) -> bool:
    return (
        row["seconds"] <= FLOORS["max_seconds"]
        and row["success_end"] - row["success_step0"] >= FLOORS["min_gain"]
        and row["tool_calls_end"] > row["tool_calls_step0"]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    rows: list[dict[str, object]] = []
    curves: list[dict[str, object]] = []
    for seed in args.seeds:
        with tempfile.TemporaryDirectory(prefix=f"tool-calculator-{seed}-") as workdir:
            row = run_seed(seed, Path(workdir), curves)
        row["meets_floors"] = meets_floors(row)
        rows.append(row)
        print(row, flush=True)
    for path, table in ((RESULTS, rows), (CURVES, curves)):
        with path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(table[0]))
            writer.writeheader()
            writer.writerows(table)
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs\n")
    print("| seed | time (s) | steps | success step 0 | success end | gain (points) | calls/episode 0 -> end "
          "| turns/episode 0 -> end |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['seed']} | {r['seconds']} | {r['steps']} | {r['success_step0']:.1%} | {r['success_end']:.1%} | "
              f"{r['gain_points']:+} | {r['tool_calls_step0']:.2f} -> {r['tool_calls_end']:.2f} | "
              f"{r['turns_step0']:.2f} -> {r['turns_end']:.2f} |")
    return 0 if all(r["meets_floors"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

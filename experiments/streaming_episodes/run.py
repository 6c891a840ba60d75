"""The tool-use demo streamed: multi-turn calculator episodes sampled by vLLM in its own process while the trainer
trains, against the same demo synchronous on the same engine (issue 39).

    python experiments/streaming_episodes/run.py                  # 2 modes x 3 seeds, 100 steps

Each run is ``python -m gspo_lightning fit -c configs/tool_calculator.yaml`` with ``sampler.engine:
vllm_process`` (vLLM's engine core bound to core 1, ``cpu_cores: "1"``; the trainer on core 0, ``taskset -c 0``),
``trainer.max_steps: 100`` and the held-out evaluation every 25 steps; ``streaming`` adds
``sampler.asynchronous.mode: streaming`` at its defaults (``max_staleness: 2``, chunks of 32 tokens), so one
episode's policy tokens may come from up to three policy versions. The warm start of each seed is built once into
a shared cache before the runs.

Writes ``results.csv`` (one row per mode and seed: held-out success at step 0 and 100, the gain, the largest
``rollout/lag_tokens_max`` of any round, mean turns and calculator calls per training episode, wall seconds) and
``curves.csv`` (held-out success by step) beside this file, prints a Markdown table and exits non-zero unless every
streamed run gains at least 20 points of held-out success and no round's token lag exceeds the bound.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from experiments.common import machine, per_step, seed_overrides, write_csv

HERE = Path(__file__).resolve().parent
CONFIG = ROOT / "configs/tool_calculator.yaml"
EVERY, BOUND, MIN_GAIN = 25, 2, 0.20
MODES = {"sync": [], "streaming": ["--sampler.asynchronous.mode=streaming"]}  # streaming's max_staleness: 2
ENGINE = '{"class_path": "gspo_lightning.engines.VLLMProcessEngine", "init_args": {"cpu_cores": "1"}}'


def _environment(cache: Path) -> dict[str, str]:
    return dict(os.environ, GSPO_LIGHTNING_CACHE=str(cache), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
                MKL_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1")  # fmt: skip


def _fit(workdir: Path, overrides: list[str], cache: Path, environment: dict[str, str], prefix=()) -> float:
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    command = [*prefix, sys.executable, "-m", "gspo_lightning", "fit", "-c", str(CONFIG), *overrides,
               "--trainer.enable_progress_bar=false", "--trainer.logger.init_args.save_dir=runs"]  # fmt: skip
    started = time.perf_counter()
    result = subprocess.run(command, check=False, cwd=workdir, env=environment, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"run in {workdir} failed:\n{result.stderr[-4000:]}")
    return time.perf_counter() - started


def _warm_start(cache: Path, seed: int) -> None:
    """The seed's supervised warm start into the shared cache, on both cores, before the runs."""
    overrides = ["--trainer.max_steps=1", "--evaluation.every_n_steps=0", *seed_overrides(seed)]
    _fit(HERE / "work" / f"warm_{seed}", overrides, cache, dict(os.environ, GSPO_LIGHTNING_CACHE=str(cache)))


def run(mode: str, seed: int, max_steps: int, cache: Path, curves: list[dict]) -> dict:
    workdir = HERE / "work" / f"{mode}_{seed}"
    overrides = [f"--trainer.max_steps={max_steps}", f"--evaluation.every_n_steps={EVERY}", f"--sampler.engine={ENGINE}",
                 *seed_overrides(seed), *MODES[mode]]  # fmt: skip
    seconds = _fit(workdir, overrides, cache, _environment(cache), prefix=("taskset", "-c", "0"))
    steps = per_step(next(workdir.glob("runs/*/version_0/metrics.csv")))
    accuracy = {step: row["eval/accuracy"] for step, row in sorted(steps.items()) if "eval/accuracy" in row}
    curves += [{"mode": mode, "seed": seed, "step": step, "accuracy": value} for step, value in accuracy.items()]
    rounds = [row for row in steps.values() if "rollout/turns_mean" in row]
    lags = [row["rollout/lag_tokens_max"] for row in rounds if "rollout/lag_tokens_max" in row]
    return {
        "mode": mode, "seed": seed, "seconds": round(seconds, 1),
        "success_step0": accuracy[0], "success_end": accuracy[max_steps],
        "gain_points": round(100 * (accuracy[max_steps] - accuracy[0]), 1),
        "lag_tokens_max": max(lags) if lags else 0.0,
        "turns_mean": round(sum(r["rollout/turns_mean"] for r in rounds) / len(rounds), 3),
        "tool_calls_mean": round(sum(r["rollout/tool_calls_mean"] for r in rounds) / len(rounds), 3),
    }  # fmt: skip


def passes(row: dict) -> bool:
    return row["mode"] != "streaming" or (row["gain_points"] >= 100 * MIN_GAIN and row["lag_tokens_max"] <= BOUND)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    args = parser.parse_args()
    cache, rows, curves = HERE / "work" / "cache", [], []
    for seed in args.seeds:
        _warm_start(cache, seed)
        for mode in args.modes:
            rows.append(run(mode, seed, args.steps, cache, curves))
            print(rows[-1], flush=True)
    write_csv(HERE / "results.csv", rows)
    write_csv(HERE / "curves.csv", curves)
    shutil.rmtree(HERE / "work", ignore_errors=True)
    print(f"\n{machine()}\n")
    print("| mode | seed | success step 0 -> end | gain (points) | lag_tokens_max | turns | calls | time (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['mode']} | {r['seed']} | {r['success_step0']:.1%} -> {r['success_end']:.1%} | "
              f"{r['gain_points']:+} | {r['lag_tokens_max']:g} | {r['turns_mean']} | {r['tool_calls_mean']} | "
              f"{r['seconds']} |")  # fmt: skip
    return 0 if all(passes(r) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Synchronous against fixed-lag and streaming rollouts, one core for the engine and one for the trainer.

    python experiments/bench/async_rollouts.py                  # 3 modes x 3 seeds, about 35 minutes on 2 cores
    python experiments/bench/async_rollouts.py --seeds 0 --steps 100    # a quick look
    python experiments/bench/async_rollouts.py --engine vllm_server --modes sync fixed_lag    # over a vLLM server

The quick start (warm-started tiny Qwen3, 3-digit addition, P x G = 16 x 8, K = 4) with
``sampler.engine: vllm_process``: vLLM's engine core in a process of its own, its threads bound to core 1
(``cpu_cores: "1"``; with ``--engine vllm_server``: a vLLM server the engine starts on core 1), the trainer's
process on core 0 (``taskset -c 0``), one thread each (``OMP_NUM_THREADS=1``).
Every mode does the same work, with ``model.rollout_correction.mode: tis``:

- ``sync``: ``sampler.asynchronous.mode: off``: each round the engine samples while the trainer waits, then the
  trainer trains K steps while the engine waits;
- ``fixed_lag``: ``mode: fixed_lag, lag: 1``: the engine samples round r + 1 (with the weights of round r's
  start) while round r trains;
- ``streaming``: ``mode: streaming`` at its defaults (``max_staleness: 2``, ``chunk_tokens: 32``): the engine never
  waits for a round, loads new weights between chunks, and admits prompts as far ahead as the bound allows.

Measured from each run's own clock (a callback stamping every optimizer step): optimizer steps per second after
the first round (the engine's start and the first, unoverlapped round left out), the engine's busy fraction
(``time/generate_s`` + ``time/reward_s``: the producer's time on a round / wall time), the trainer's waiting
fraction (``time/trainer_wait_s``), and held-out greedy accuracy (256 prompts) every 100 steps, against steps and
wall time. Results: ``results.csv`` (one row per run), ``curves.csv`` (accuracy by step and second),
``output.txt`` (the summary).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
ENGINES = {
    "vllm_process": ("gspo_lightning.engines.VLLMProcessEngine", {"cpu_cores": "1"}, "async_rollouts"),
    "vllm_server": ("gspo_lightning.engines.VLLMServerEngine", {"cpu_cores": ["1"], "port": 8231},
                    "async_rollouts_server"),
}
"""Each engine: its class, its options (the engine on core 1), the folder under ``experiments/`` its results go to."""
MODES = {
    "sync": ["--sampler.asynchronous.mode=off"],
    "fixed_lag": ["--sampler.asynchronous.mode=fixed_lag", "--sampler.asynchronous.lag=1"],
    "streaming": ["--sampler.asynchronous.mode=streaming"],  # its defaults: max_staleness 2, chunks of 32 tokens
}
K = 4
CONFIG = ROOT / "configs/scratchpad.yaml"
EVERY = 50


class StepClock(pl.Callback):
    """Writes ``step,seconds`` (``time.perf_counter``) after every optimizer step to ``clock.csv``."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        with open("clock.csv", "a") as handle:
            handle.write(f"{trainer.global_step},{time.perf_counter()}\n")


def _command(mode: str, seed: int, steps: int, engine_name: str) -> list[str]:
    class_path, options, _ = ENGINES[engine_name]
    engine = json.dumps({"class_path": class_path, "init_args": options})
    return [
        "taskset", "-c", "0", sys.executable, "-m", "gspo_lightning", "fit", "-c", str(CONFIG),
        f"--trainer.max_steps={steps}",
        "--trainer.enable_progress_bar=false", "--trainer.logger.init_args.save_dir=runs",
        "--trainer.callbacks+=experiments.bench.async_rollouts.StepClock",
        f"--sampler.engine={engine}", "--model.init_args.rollout_correction.mode=tis",
        f"--evaluation.every_n_steps={EVERY}",
        f"--seed_everything={seed}", f"--model.init_args.policy.init_args.seed={seed}", f"--data.init_args.seed={seed}",
        *MODES[mode],
    ]  # fmt: skip


def _environment(cache: Path) -> dict[str, str]:
    return dict(os.environ, GSPO_LIGHTNING_CACHE=str(cache), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
                VLLM_CPU_KVCACHE_SPACE="1", MKL_NUM_THREADS="1")  # fmt: skip


def _warm_start(out: Path, cache: Path, seed: int) -> None:
    """The warm start of this seed into the cache, on both cores, before anything is timed."""
    workdir = out / "work" / f"warm_{seed}"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    command = [sys.executable, "-m", "gspo_lightning", "fit", "-c", str(CONFIG),
               "--trainer.max_steps=1", "--evaluation.every_n_steps=0", "--trainer.enable_progress_bar=false",
               f"--model.init_args.policy.init_args.seed={seed}", f"--data.init_args.seed={seed}"]  # fmt: skip
    environment = dict(os.environ, GSPO_LIGHTNING_CACHE=str(cache), PYTHONPATH=str(ROOT))
    subprocess.run(command, cwd=workdir, env=environment, check=True, capture_output=True)


def _run(out: Path, engine: str, mode: str, seed: int, steps: int, cache: Path) -> dict:
    workdir = out / "work" / f"{mode}_{seed}"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    result = subprocess.run(_command(mode, seed, steps, engine), cwd=workdir, env=_environment(cache),
                            capture_output=True, text=True)  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"{mode} seed {seed} failed:\n{result.stderr[-4000:]}")
    clock = [tuple(map(float, line.split(","))) for line in (workdir / "clock.csv").read_text().splitlines()]
    stamp = {int(step): seconds for step, seconds in clock}
    rows = list(csv.DictReader(next(workdir.glob("runs/*/version_0/metrics.csv")).open()))
    return {"mode": mode, "seed": seed, "stamp": stamp, "rows": rows}


def _summary(run: dict, steps: int) -> dict:
    stamp, rows = run["stamp"], run["rows"]
    first, last = K, steps  # after the first round: the engine's start and round 0 are not overlapped in either mode
    wall = stamp[last] - stamp[first]

    def total(name: str) -> float:
        return sum(float(r[name]) for r in rows if r.get(name) and first <= int(r["step"]) < last)

    accuracy = {int(r["step"]): float(r["eval/accuracy"]) for r in rows if r.get("eval/accuracy")}
    return {
        "mode": run["mode"], "seed": run["seed"], "steps_per_s": (last - first) / wall, "wall_s": wall,
        "engine_busy_frac": (total("time/generate_s") + total("time/reward_s")) / wall,
        "trainer_wait_frac": total("time/trainer_wait_s") / wall if run["mode"] != "sync" else
        (total("time/generate_s") + total("time/reward_s")) / wall,
        "train_frac": (total("time/old_logprob_s") + total("time/train_s")) / wall,
        "accuracy_start": accuracy.get(0), "accuracy_end": accuracy.get(steps),
        "accuracy_gain": accuracy.get(steps, float("nan")) - accuracy.get(0, float("nan")),
        "clip_frac_mean": statistics.mean(float(r["train/clip_frac"]) for r in rows if r.get("train/clip_frac")),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                        help="run these modes only; the other modes' rows of results.csv and curves.csv are kept")
    parser.add_argument("--engine", choices=list(ENGINES), default="vllm_process",
                        help="vllm_process (results in experiments/async_rollouts/) or vllm_server (a vLLM server the "
                        "engine starts; experiments/async_rollouts_server/)")
    parser.add_argument("--report", action="store_true", help="rebuild output.txt from results.csv, run nothing")
    args = parser.parse_args()
    out = ROOT / "experiments" / ENGINES[args.engine][2]
    if args.report:
        _report(out, args.engine, list(csv.DictReader((out / "results.csv").open())), args.seeds, args.steps)
        return
    cache = out / "work" / "cache"  # the warm starts, removed with the runs
    out.mkdir(parents=True, exist_ok=True)
    summaries, curves = _kept(out / "results.csv", args.modes), _kept(out / "curves.csv", args.modes)
    for seed in args.seeds:
        _warm_start(out, cache, seed)
        for mode in args.modes:
            run = _run(out, args.engine, mode, seed, args.steps, cache)
            summaries.append(_summary(run, args.steps))
            print(summaries[-1], flush=True)
            zero = run["stamp"][K] - (run["stamp"][2 * K] - run["stamp"][K])  # wall time 0: one round before step 4
            for row in run["rows"]:
                if row.get("eval/accuracy"):
                    step = int(row["step"])
                    seconds = run["stamp"].get(step, zero) - zero if step else 0.0
                    curves.append({"mode": mode, "seed": seed, "step": step, "wall_s": round(seconds, 2),
                                   "accuracy": float(row["eval/accuracy"])})  # fmt: skip
    _write(out / "results.csv", summaries)
    _write(out / "curves.csv", curves)
    _report(out, args.engine, summaries, args.seeds, args.steps)
    shutil.rmtree(out / "work", ignore_errors=True)


def _kept(path: Path, rerun: list[str]) -> list[dict]:
    """The rows of an earlier run's CSV whose mode is not run again."""
    if not path.exists():
        return []
    return [row for row in csv.DictReader(path.open()) if row["mode"] not in rerun]


def _report(out: Path, engine: str, summaries: list[dict], seeds: list[int], steps: int) -> None:
    """``output.txt`` from the runs' summaries (``--report`` rebuilds it from ``results.csv``)."""
    lines = [f"# python experiments/bench/async_rollouts.py --engine {engine} --seeds {' '.join(map(str, seeds))} "
             f"--steps {steps}  "
             f"({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"]  # fmt: skip
    modes = [mode for mode in MODES if any(s["mode"] == mode for s in summaries)]
    for mode in modes:
        rows = [s for s in summaries if s["mode"] == mode]
        mean = {key: statistics.mean(float(r[key]) for r in rows) for key in rows[0] if key not in ("mode", "seed")}
        lines.append(f"{mode:>9}: {mean['steps_per_s']:.3f} steps/s  engine busy {mean['engine_busy_frac']:.0%}  "
                     f"trainer waiting {mean['trainer_wait_frac']:.0%}  training {mean['train_frac']:.0%}  "
                     f"clip fraction {mean['clip_frac_mean']:.3f}  accuracy gain {100 * mean['accuracy_gain']:+.1f} "
                     "points (per seed: " + ", ".join(f"{100 * float(r['accuracy_gain']):+.1f}" for r in rows) + ")")
    by = {(r["mode"], int(r["seed"])): float(r["steps_per_s"]) for r in summaries}
    sync = statistics.mean(by[("sync", seed)] for seed in seeds)
    for mode in modes[1:]:
        ratios = [by[(mode, seed)] / by[("sync", seed)] for seed in seeds]
        faster = statistics.mean(by[(mode, seed)] for seed in seeds) / sync
        lines.append(f"{mode} / sync: {faster:.2f}x optimizer steps per second (per seed: "
                     + ", ".join(f"{ratio:.2f}x" for ratio in ratios) + ")")  # fmt: skip
    split = [s for s in summaries if s["mode"] == "sync"]
    ideal = statistics.mean(1 / max(float(s["train_frac"]), float(s["engine_busy_frac"])) for s in split)
    lines.append(f"perfect overlap of sync's own split (the longer of sampling and training per round): {ideal:.2f}x")
    (out / "output.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _write(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()

"""GSPO, GSPO-token and GRPO under staleness: fixed lag 0, 1, 2, 4 and streaming, the same sample budget.

    python experiments/staleness/run.py              # 3 objectives x 6 modes x 3 seeds, about 95 minutes on 2 cores
    python experiments/staleness/run.py --seeds 0 --steps 40 --out /tmp/staleness   # a quick look
    python experiments/staleness/run.py --replot     # tables and plot again from progress.jsonl

The quick start (warm-started tiny Qwen3, 3-digit addition, P x G = 16 x 8, K = 4 minibatches a round,
responses of at most 8 tokens) for ``--steps`` optimizer steps (400: 100 rounds), so every run trains on the same
number of samples.
Sampling runs on an engine of its own (``gspo_lightning.engines.VLLMProcessEngine``), its threads on core 1,
the trainer on core 0 (``taskset -c 0``), one thread each, as in ``experiments/bench/async_rollouts.py``; every
run uses ``model.rollout_correction.mode: tis`` (the cap C = 2), so the only difference between modes is the lag:

- ``lag 0``: ``sampler.asynchronous.mode: off``, on-policy rounds;
- ``lag k`` (1, 2, 4): ``mode: fixed_lag, lag: k``: round r sampled with the weights of round r - k's start;
- ``streaming``: ``mode: streaming`` at its defaults (``max_staleness: 2``, chunks of 32 tokens);
- ``lag 4, no TIS``: lag 4 with ``rollout_correction.mode: off``: what the correction contributes (the proximal
  pi_old stays; nothing weighs the gap between it and the behaviour policy).

pi_old is the proximal policy (the weights at the start of the round a sample is trained in, recomputed); the
engine's log-probs are the behaviour policy's. Per run: held-out greedy accuracy (256 problems) every 50 steps
against steps and wall time (each optimizer step stamped), the clip fraction against pi_old
(``diag/clip_frac_resp``, by lag) and the clip fraction had pi_old been the behaviour policy
(``diag/behaviour_clip_frac_resp``: what a trainer that clips against the engine's log-probs would see), and the
correction's sequence log-weight log(pi_prox / pi_behav) by lag (``mismatch/log_ratio_mean_lag_<k>``, its
fraction capped ``mismatch/truncated_frac``). Results: ``results.csv`` (one row per run), ``curves.csv``
(accuracy by step and second), ``output.txt`` (the tables), ``staleness.png``; ``progress.jsonl`` lets an
interrupted run resume where it stopped.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

ROOT = common.ROOT
HERE = Path(__file__).resolve().parent
OBJECTIVES = ("gspo", "gspo_token", "grpo")
MODES = {
    "lag 0": ["--sampler.asynchronous.mode=off"],
    "lag 1": ["--sampler.asynchronous.mode=fixed_lag", "--sampler.asynchronous.lag=1"],
    "lag 2": ["--sampler.asynchronous.mode=fixed_lag", "--sampler.asynchronous.lag=2"],
    "lag 4": ["--sampler.asynchronous.mode=fixed_lag", "--sampler.asynchronous.lag=4"],
    "streaming": ["--sampler.asynchronous.mode=streaming"],
    "lag 4, no TIS": ["--sampler.asynchronous.mode=fixed_lag", "--sampler.asynchronous.lag=4",
                      "--model.init_args.rollout_correction.mode=off"],
}
CORRECTED = [mode for mode in MODES if "no TIS" not in mode]  # the by-lag figures: TIS on, only the lag differs
LAGS = (0, 1, 2, 3, 4)
EVERY = 50
K = 4
ENGINE = '{"class_path": "gspo_lightning.engines.VLLMProcessEngine", "init_args": {"cpu_cores": "1"}}'
BENCH = common.load_script(ROOT / "experiments/bench/async_rollouts.py")  # its step clock, warm start, environment


def command(objective: str, mode: str, seed: int, steps: int) -> list[str]:
    return [
        "taskset", "-c", "0", sys.executable, "-m", "gspo_lightning", "fit", "-c", str(common.QUICKSTART),
        f"--trainer.max_steps={steps}", "--trainer.enable_progress_bar=false",
        "--trainer.logger.init_args.save_dir=runs",
        "--trainer.callbacks+=experiments.bench.async_rollouts.StepClock",
        f"--sampler.engine={ENGINE}", "--model.init_args.rollout_correction.mode=tis",
        f"--model.init_args.objective={objective}", f"--evaluation.every_n_steps={EVERY}",
        *common.seed_overrides(seed), *MODES[mode],
    ]  # fmt: skip


def mean(rows: list[dict], key: str) -> float:
    values = [float(r[key]) for r in rows if r.get(key) not in (None, "")]
    return statistics.mean(values) if values else math.nan


def run_one(objective: str, mode: str, seed: int, steps: int, work: Path, cache: Path) -> dict:
    workdir = work / f"{objective}_{mode.replace(' ', '')}_{seed}"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    result = subprocess.run(command(objective, mode, seed, steps), cwd=workdir, env=BENCH._environment(cache),
                            capture_output=True, text=True)  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"{objective} {mode} seed {seed} failed:\n{result.stderr[-4000:]}")
    stamp = {int(s): float(t) for s, t in (line.split(",") for line in (workdir / "clock.csv").read_text().split())}
    rows = list(csv.DictReader(next(workdir.glob("runs/*/version_0/metrics.csv")).open()))
    zero = stamp[K] - (stamp[2 * K] - stamp[K])  # wall time 0: one round before step K, as the async benchmark
    curve = [{"step": int(r["step"]), "wall_s": round(stamp.get(int(r["step"]), zero) - zero, 2) if int(r["step"]) else 0.0,
              "accuracy": float(r["eval/accuracy"])} for r in rows if r.get("eval/accuracy")]  # fmt: skip
    accuracy = {point["step"]: point["accuracy"] for point in curve}
    summary = {
        "objective": objective, "mode": mode, "seed": seed, "steps_per_s": (steps - K) / (stamp[steps] - stamp[K]),
        "accuracy_start": accuracy[0], "accuracy_end": accuracy[max(accuracy)], "gain_points": 100 * (accuracy[max(accuracy)] - accuracy[0]),
        "accuracy_best": max(accuracy.values()), "clip_frac": mean(rows, "diag/clip_frac_resp"),
        "behaviour_clip_frac": mean(rows, "diag/behaviour_clip_frac_resp"), "lag_mean": mean(rows, "rollout/lag_sequences_mean"),
        "truncated_frac": mean(rows, "mismatch/truncated_frac"), "reward_mean": mean(rows, "rollout/reward_mean"),
    }  # fmt: skip
    for lag in LAGS:
        summary[f"clip_frac_lag_{lag}"] = mean(rows, f"diag/clip_frac_lag_{lag}")
        summary[f"behaviour_clip_frac_lag_{lag}"] = mean(rows, f"diag/behaviour_clip_frac_lag_{lag}")
        summary[f"log_weight_lag_{lag}"] = mean(rows, f"mismatch/log_ratio_mean_lag_{lag}")
    return {"summary": summary, "curve": curve}


def runs_to_do(args) -> list[tuple[str, str, int]]:
    return [(o, m, s) for s in args.seeds for m in args.modes for o in args.objectives]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--objectives", nargs="+", choices=OBJECTIVES, default=list(OBJECTIVES))
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--out", type=Path, default=HERE, help="where the results go (default: next to this script)")
    parser.add_argument("--replot", action="store_true", help="rebuild the tables and plot from progress.jsonl")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    progress = args.out / "progress.jsonl"
    done = common.read_progress(progress)
    if not args.replot:
        work, cache = args.out / "work", args.out / "work" / "cache"
        finished = {(d["summary"]["objective"], d["summary"]["mode"], d["summary"]["seed"]) for d in done}
        warmed = set()
        for objective, mode, seed in runs_to_do(args):
            if (objective, mode, seed) in finished:
                continue
            if seed not in warmed:  # the warm start into the cache, before anything is timed
                BENCH.OUT = work
                BENCH.CONFIG = common.QUICKSTART
                BENCH._warm_start(cache, seed)
                warmed.add(seed)
            done.append(run_one(objective, mode, seed, args.steps, work, cache))
            common.append_progress(progress, done[-1])
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in done[-1]["summary"].items()
                   if "lag_" not in k}, flush=True)  # fmt: skip
        shutil.rmtree(work, ignore_errors=True)
    report(done, args)
    return 0


def report(done: list[dict], args) -> None:
    summaries = [d["summary"] for d in done]
    common.write_csv(args.out / "results.csv", summaries)
    common.write_csv(args.out / "curves.csv", [{"objective": d["summary"]["objective"], "mode": d["summary"]["mode"],
                                                  "seed": d["summary"]["seed"], **p} for d in done for p in d["curve"]])  # fmt: skip
    lines = [f"# python experiments/staleness/run.py --steps {args.steps}  ({common.machine()})", "",
             "| objective | mode | seeds | gain (points, per seed) | best accuracy | steps/s | mean lag | clip frac vs pi_prox "
             "| clip frac vs behaviour | TIS capped |", "|" + " --- |" * 10]  # fmt: skip
    for objective in OBJECTIVES:
        for mode in MODES:
            rows = [s for s in summaries if s["objective"] == objective and s["mode"] == mode]
            if not rows:
                continue
            gains = ", ".join(f"{r['gain_points']:+.1f}" for r in rows)
            lines.append(
                f"| {objective} | {mode} | {len(rows)} | {statistics.mean(r['gain_points'] for r in rows):+.1f} ({gains}) "
                f"| {100 * statistics.mean(r['accuracy_best'] for r in rows):.1f}% | {statistics.mean(r['steps_per_s'] for r in rows):.2f} "
                f"| {statistics.mean(r['lag_mean'] for r in rows):.2f} | {statistics.mean(r['clip_frac'] for r in rows):.3f} "
                f"| {statistics.mean(r['behaviour_clip_frac'] for r in rows):.3f} | {statistics.mean(r['truncated_frac'] for r in rows):.4f} |"
            )  # fmt: skip
    lines += ["", "By lag (responses of that lag, means over runs and steps): clip fraction against pi_prox / against "
              "the behaviour policy / the correction's mean sequence log-weight log(pi_prox / pi_behav)", "",
              "| objective | mode | " + " | ".join(f"lag {k}" for k in LAGS) + " |", "|" + " --- |" * (2 + len(LAGS))]  # fmt: skip
    for objective in OBJECTIVES:
        for mode in MODES:
            rows = [s for s in summaries if s["objective"] == objective and s["mode"] == mode]
            if not rows:
                continue
            cells = []
            for k in LAGS:
                values = [statistics.mean(r[f"{name}_lag_{k}"] for r in rows) for name in ("clip_frac", "behaviour_clip_frac", "log_weight")]
                cells.append("-" if any(math.isnan(v) for v in values) else f"{values[0]:.3f} / {values[1]:.3f} / {values[2]:+.4f}")
            lines.append(f"| {objective} | {mode} | " + " | ".join(cells) + " |")
    (args.out / "output.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(done, args.out / "staleness.png")


def plot(done: list[dict], path: Path) -> None:
    figure, axes = common.grid_figure(3, 3, (16, 12))
    colors = dict(zip(MODES, ["black", "tab:blue", "tab:orange", "tab:red", "tab:green", "tab:purple"]))
    for column, objective in enumerate(OBJECTIVES):
        for mode, color in colors.items():
            runs = [d for d in done if d["summary"]["objective"] == objective and d["summary"]["mode"] == mode]
            if not runs:
                continue
            common.plot_band(axes[0, column], [([p["step"] for p in d["curve"]], [100 * p["accuracy"] for p in d["curve"]])
                                               for d in runs], mode, color)  # fmt: skip
            common.plot_band(axes[1, column], [([p["wall_s"] for p in d["curve"]], [100 * p["accuracy"] for p in d["curve"]])
                                               for d in runs], mode, color)  # fmt: skip
        for label, key, marker in (("vs pi_prox", "clip_frac", "o-"), ("vs behaviour", "behaviour_clip_frac", "s--")):
            runs = [d["summary"] for d in done if d["summary"]["objective"] == objective and d["summary"]["mode"] in CORRECTED]
            lags = [k for k in LAGS if any(not math.isnan(r[f"{key}_lag_{k}"]) for r in runs)]
            values = [statistics.mean(v for r in runs if not math.isnan(v := r[f"{key}_lag_{k}"])) for k in lags]
            axes[2, column].plot(lags, values, marker, label=label)
        axes[0, column].set_title(objective)
    for column in range(3):
        common.finish_axes([axes[0, column], axes[1, column], axes[2, column]], [
            ("optimizer step", "held-out accuracy (%)"), ("wall seconds (engine and trainer overlapped)", "held-out accuracy (%)"),
            ("policy lag of the responses", "clip fraction (responses)")])  # fmt: skip
    common.save_figure(figure, "Staleness on 3-digit addition: mean, band = min-max over seeds", path)


if __name__ == "__main__":
    raise SystemExit(main())

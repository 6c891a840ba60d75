"""Claims 1 and 2 of the paper at CPU scale: GSPO vs GRPO training efficiency, and how much each clips.

    python experiments/gspo_vs_grpo/run.py            # about 45 minutes on 2 CPU cores

Both objectives start from the same warm start per seed (the quick start's, cached once per seed) and see the
same rollout budget: the quick-start config (3-digit addition, P=16 prompts x G=8 responses, K=4 minibatches,
2000 optimizer steps), each with the paper's clipping (GSPO eps 3e-4 / 4e-4 on the sequence ratio, GRPO
0.2 / 0.27 on the token ratio). Seeds 0, 1, 2. A small sweep of GSPO's eps on seed 0 shows its sensitivity.

Writes beside this file: ``curves.csv`` (every run's per-step reward, clip fraction, training clock and
held-out accuracy), ``results.csv`` (one row per run), ``efficiency.png`` and ``eps_sweep.png``.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import machine, plot_band, run_fit, seed_overrides, series, smooth, training_clock, write_csv  # noqa: E402

HERE = Path(__file__).parent
EVAL_EVERY = 100
OBJECTIVES = {"GSPO (3e-4/4e-4)": ["--model.init_args.objective=gspo"], "GRPO (0.2/0.27)": ["--model.init_args.objective=grpo"]}
EPS_SWEEP = [(1e-4, 1.33e-4), (1e-3, 1.33e-3), (3e-3, 4e-3)]  # the paper's 3e-4 / 4e-4 is in OBJECTIVES


def runs(seeds: list[int]) -> list[tuple[str, int, list[str]]]:
    planned = [(name, seed, flags) for seed in seeds for name, flags in OBJECTIVES.items()]
    for low, high in EPS_SWEEP:
        flags = ["--model.init_args.objective=gspo", f"--model.init_args.eps_low={low}", f"--model.init_args.eps_high={high}"]
        planned.append((f"GSPO ({low:g}/{high:g})", seeds[0], flags))
    return planned


def curve_rows(name: str, seed: int, steps: dict) -> list[dict]:
    clock = training_clock(steps)
    rows = []
    for step, values in sorted(steps.items()):
        rows.append({
            "run": name, "seed": seed, "step": step, "train_seconds": round(clock[step], 3),
            "reward_mean": values.get("rollout/reward_mean", math.nan),
            "clip_frac": values.get("train/clip_frac", math.nan),
            "eval_accuracy": values.get("eval/accuracy", math.nan),
        })  # fmt: skip
    return rows


def summary_row(name: str, seed: int, result: dict) -> dict:
    steps = result["steps"]
    _, accuracy = series(steps, "eval/accuracy")
    _, clip = series(steps, "train/clip_frac")
    _, reward = series(steps, "rollout/reward_mean")
    return {
        "run": name, "seed": seed, "seconds": round(result["seconds"], 1),
        "train_seconds": round(training_clock(steps)[max(steps)], 1),
        "accuracy_start": accuracy[0], "accuracy_end": accuracy[-1], "accuracy_best": max(accuracy),
        "reward_last200": sum(reward[-200:]) / len(reward[-200:]),
        "clip_frac_mean": sum(clip) / len(clip),
    }  # fmt: skip


def plot(curves: list[dict], path_main: Path, path_sweep: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def by_run(name):
        seeds = sorted({r["seed"] for r in curves if r["run"] == name})
        return [[r for r in curves if r["run"] == name and r["seed"] == s] for s in seeds]

    colors = {name: color for name, color in zip(OBJECTIVES, ["tab:blue", "tab:red"])}
    figure, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    for name, color in colors.items():
        runs_ = by_run(name)
        evaluated = [[r for r in run if not math.isnan(r["eval_accuracy"])] for run in runs_]
        plot_band(axes[0, 0], [([r["step"] for r in e], [100 * r["eval_accuracy"] for r in e]) for e in evaluated], name, color)
        plot_band(axes[0, 1], [([r["train_seconds"] for r in e], [100 * r["eval_accuracy"] for r in e]) for e in evaluated], name, color)
        plot_band(axes[1, 0], [([r["step"] for r in run], smooth([r["reward_mean"] for r in run], 50)) for run in runs_], name, color)
        plot_band(axes[1, 1], [([r["step"] for r in run], smooth([r["clip_frac"] for r in run], 50)) for run in runs_], name, color)
    labels = [
        ("optimizer step", "held-out accuracy (%)"), ("training time (s, sampling + scoring + updates)", "held-out accuracy (%)"),
        ("optimizer step", "training reward (moving avg. 50)"), ("optimizer step", "token-weighted clip fraction (moving avg. 50)"),
    ]  # fmt: skip
    for axis, (xlabel, ylabel) in zip(axes.flat, labels):
        axis.set_xlabel(xlabel)
        axis.set_ylabel(ylabel)
        axis.grid(alpha=0.3)
        axis.legend()
    axes[1, 1].set_yscale("log")
    seeds = len({r["seed"] for r in curves if r["run"] in OBJECTIVES})
    figure.suptitle(f"GSPO vs GRPO, quick-start task, same warm start and rollout budget (mean, band = min-max over {seeds} seeds)")
    figure.tight_layout()
    figure.savefig(path_main, dpi=110)

    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    sweep = ["GSPO (3e-4/4e-4)"] + [f"GSPO ({low:g}/{high:g})" for low, high in EPS_SWEEP]
    for name, color in zip(sweep, ["tab:blue", "tab:green", "tab:orange", "tab:purple"]):
        run = next(run for run in by_run(name) if run[0]["seed"] == min(r["seed"] for r in curves))
        evaluated = [r for r in run if not math.isnan(r["eval_accuracy"])]
        axes[0].plot([r["step"] for r in evaluated], [100 * r["eval_accuracy"] for r in evaluated], label=name, color=color)
        axes[1].plot([r["step"] for r in run], smooth([r["clip_frac"] for r in run], 50), label=name, color=color)
    for axis, ylabel in zip(axes, ["held-out accuracy (%)", "token-weighted clip fraction (moving avg. 50)"]):
        axis.set_xlabel("optimizer step")
        axis.set_ylabel(ylabel)
        axis.grid(alpha=0.3)
        axis.legend()
    axes[1].set_yscale("log")
    figure.suptitle("GSPO clipping range (eps_low / eps_high), seed 0")
    figure.tight_layout()
    figure.savefig(path_sweep, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=2000)
    args = parser.parse_args()
    curves, summary = [], []
    with tempfile.TemporaryDirectory(prefix="gspo-vs-grpo-") as scratch:
        for index, (name, seed, flags) in enumerate(runs(args.seeds)):
            overrides = [*seed_overrides(seed), *flags, f"--evaluation.every_n_steps={EVAL_EVERY}", f"--trainer.max_steps={args.max_steps}"]
            result = run_fit(Path(scratch) / f"run{index}", overrides, cache=Path(scratch) / "cache")
            curves += curve_rows(name, seed, result["steps"])
            summary.append(summary_row(name, seed, result))
            print(summary[-1], flush=True)
    write_csv(HERE / "curves.csv", curves)
    write_csv(HERE / "results.csv", summary)
    plot(curves, HERE / "efficiency.png", HERE / "eps_sweep.png")
    print(f"\nmachine: {machine()}")
    print("| run | seed | accuracy start | end | best | reward (last 200) | clip frac | train s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in summary:
        print(f"| {r['run']} | {r['seed']} | {r['accuracy_start']:.1%} | {r['accuracy_end']:.1%} | {r['accuracy_best']:.1%} | "
              f"{r['reward_last200']:.3f} | {r['clip_frac_mean']:.2e} | {r['train_seconds']} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

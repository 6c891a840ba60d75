"""Every registered objective on the quick-start task, same rollout budget, and GSPO with dynamic sampling.

    python experiments/objectives/run.py            # about 45 minutes on 2 CPU cores

The quick-start config (3-digit addition, warm-started tiny Qwen3, P=16 prompts x G=8 responses, K=4
minibatches), 600 optimizer steps per run (150 rounds), each objective at its own default clip range (the paper's
where a paper gives one), held-out greedy accuracy on 256 problems every 100 steps; seeds 0, 1, 2, the warm start
shared per seed. GSPO once more with ``sampler.dynamic_sampling: true`` (DAPO's: groups whose 8 rewards are equal
are replaced by informative ones, at most 4 extra draws a round), which costs more sampling per round.

Writes beside this file: ``curves.csv`` (every run's per-step reward, clip or gate fraction, training clock and
held-out accuracy), ``results.csv`` (one row per run), and ``objectives.png``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

HERE = Path(__file__).parent
OBJECTIVES = ("gspo", "gspo_token", "grpo", "dapo", "dr_grpo", "cispo", "gmpo", "sapo")
VARIANTS = {name: [f"--model.init_args.objective={name}"] for name in OBJECTIVES} | {
    "gspo + dynamic sampling": ["--model.init_args.objective=gspo", "--sampler.dynamic_sampling=true"],
}
KEYS = ("eval/accuracy", "rollout/reward_mean", "train/clip_frac", "rollout/zero_variance_frac", "rollout/extra_draws")
COLORS = dict(zip(VARIANTS, ["tab:blue", "tab:cyan", "tab:red", "tab:orange", "tab:brown", "tab:green",
                             "tab:purple", "tab:pink", "black"]))  # fmt: skip


def summary(curves: list[dict], finished: list[dict]) -> list[dict]:
    return common.summarise(curves, finished, {
        "clip_frac_mean": "train/clip_frac", "zero_variance_frac": "rollout/zero_variance_frac",
        "extra_draws_mean": "rollout/extra_draws",
    })  # fmt: skip


def plot(curves: list[dict], path: Path) -> None:
    figure, axes = common.grid_figure()
    for name, color in COLORS.items():
        runs = common.runs_of(curves, name)
        if not runs:
            continue
        common.plot_accuracy_and_reward(axes[0, 0], axes[0, 1], runs, name, color)
        clip = [([r["step"] for r in run], common.smooth([r["train/clip_frac"] for r in run], 50)) for run in runs]
        common.plot_band(axes[1, 0], clip, name, color)
        evaluated = [[r for r in run if not math.isnan(r["eval/accuracy"])] for run in runs]
        common.plot_band(axes[1, 1], [([r["train_seconds"] for r in e], [100 * r["eval/accuracy"] for r in e])
                                      for e in evaluated], name, color)  # fmt: skip
    axes[1, 0].set_yscale("symlog", linthresh=1e-3)
    common.finish_axes(axes.flat, [
        ("optimizer step", "held-out accuracy (%)"), ("optimizer step", "training reward (moving avg. 50)"),
        ("optimizer step", "clip / gate fraction (moving avg. 50)"), ("training seconds", "held-out accuracy (%)"),
    ])  # fmt: skip
    seeds = len({r["seed"] for r in curves})
    common.save_figure(figure, f"Objectives on 3-digit addition: mean, band = min-max over {seeds} seeds", path)


def main() -> int:
    args = common.parse_arguments(__doc__, [0, 1, 2], 600)
    flags = ["--evaluation.every_n_steps=100", f"--trainer.max_steps={args.max_steps}"]
    columns = {
        "run": "{run}", "seed": "{seed}", "accuracy start": "{accuracy_start:.1%}", "end": "{accuracy_end:.1%}",
        "best": "{accuracy_best:.1%}", "clip/gate frac": "{clip_frac_mean:.2e}",
        "zero-variance groups": "{zero_variance_frac:.2f}", "train s": "{train_seconds:.0f}", "wall s": "{seconds:.0f}",
    }  # fmt: skip
    common.run_and_report(HERE, VARIANTS, args.seeds, KEYS, flags, summary, plot, "objectives.png", columns, args.replot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

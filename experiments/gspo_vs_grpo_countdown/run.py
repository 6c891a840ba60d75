"""Claims 1 and 2 on a second task: GSPO vs GRPO on Countdown, same warm start and rollout budget.

    python experiments/gspo_vs_grpo_countdown/run.py      # about 35 minutes on 2 CPU cores

``configs/countdown_tiny.yaml``: reach a target from 3 numbers (1-10) with ``+ - * /`` and parentheses. Unlike
the quick-start addition, a problem has many correct answers and the model has to search for one; responses
are up to 12 tokens. A tiny Qwen3 is warm-started on demonstrations (30% of greedy answers right) once per
seed; then P=16 prompts x G=8 responses, K=4 minibatches, 2000 optimizer steps, each objective with the
paper's clipping (GSPO 3e-4 / 4e-4 on the sequence ratio, GRPO 0.2 / 0.27 on the token ratio); seeds 0, 1, 2.

Writes beside this file: ``curves.csv``, ``results.csv`` (one row per run) and ``efficiency.png``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

HERE = Path(__file__).parent
CONFIG = common.ROOT / "configs/countdown_tiny.yaml"
VARIANTS = {
    "GSPO (3e-4/4e-4)": ["--model.init_args.objective=gspo"],
    "GRPO (0.2/0.27)": ["--model.init_args.objective=grpo"],
}
COLORS = dict(zip(VARIANTS, ["tab:blue", "tab:red"]))
KEYS = ("eval/accuracy", "rollout/reward_mean", "train/clip_frac", "rollout/response_len_mean")


def summary(curves: list[dict], finished: list[dict]) -> list[dict]:
    rows = []
    for run in finished:
        steps = common.steps_of(curves, run)
        rows.append(run | common.outcome(steps) | {
            "train_seconds": steps[-1]["train_seconds"],
            "clip_frac_mean": common.mean_of(steps, "train/clip_frac"),
            "response_len_mean": common.mean_of(steps, "rollout/response_len_mean"),
        })  # fmt: skip
    return rows


def plot(curves: list[dict], path: Path) -> None:
    figure, axes = common.grid_figure()
    for name, color in COLORS.items():
        runs = common.runs_of(curves, name)
        common.plot_accuracy_and_reward(axes[0, 0], axes[1, 0], runs, name, color)
        evaluated = [[r for r in run if not math.isnan(r["eval/accuracy"])] for run in runs]
        common.plot_band(axes[0, 1], [([r["train_seconds"] for r in e], [100 * r["eval/accuracy"] for r in e]) for e in evaluated], name, color)
        common.plot_band(axes[1, 1], [([r["step"] for r in run], common.smooth([r["train/clip_frac"] for r in run], 50)) for run in runs], name, color)
    common.finish_axes(axes.flat, [
        ("optimizer step", "held-out accuracy (%)"), ("training time (s, sampling + scoring + updates)", "held-out accuracy (%)"),
        ("optimizer step", "training reward (moving avg. 50)"), ("optimizer step", "token-weighted clip fraction (moving avg. 50)"),
    ])  # fmt: skip
    axes[1, 1].set_yscale("log")
    seeds = len({r["seed"] for r in curves})
    common.save_figure(figure, f"GSPO vs GRPO on Countdown (3 numbers, 1-10), same warm start and rollout budget (mean, band = min-max over {seeds} seeds)", path)


def main() -> int:
    args = common.parse_arguments(__doc__, [0, 1, 2], 2000)
    flags = ["--evaluation.every_n_steps=100", f"--trainer.max_steps={args.max_steps}"]
    columns = {
        "run": "{run}", "seed": "{seed}", "accuracy start": "{accuracy_start:.1%}", "end": "{accuracy_end:.1%}",
        "best": "{accuracy_best:.1%}", "reward (last 200)": "{reward_last200:.3f}", "clip frac": "{clip_frac_mean:.2e}",
        "train s": "{train_seconds:.0f}",
    }  # fmt: skip
    common.run_and_report(
        HERE, VARIANTS, args.seeds, KEYS, flags, summary, plot, "efficiency.png", columns, args.replot, CONFIG
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

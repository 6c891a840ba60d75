"""Claim 4 at CPU scale: is GSPO more tolerant than GRPO of old log-probs from a lower-precision sampler?

    python experiments/precision/run.py          # about 25 minutes on 2 CPU cores

The quick-start task and settings (1000 steps here), GSPO (eps 3e-4 / 4e-4) and GRPO (0.2 / 0.27), each with pi_old's
log-probs either recomputed in float32 after sampling (the default, ``sampler.old_logprobs: recompute``) or
taken directly from a bfloat16 sampling pass (``sampler.old_logprobs: engine``, the ``hf`` engine's
``sampling_dtype: bfloat16``), as an inference engine would hand them over. Training itself stays in
float32. On a round's first minibatch pi_theta equals the weights that sampled, so there the ratio measures the
precision mismatch alone: the script reports its statistics and the clipping it causes. Seeds 0 and 1.

Writes beside this file: ``curves.csv``, ``results.csv`` and ``precision.png``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

HERE = Path(__file__).parent
BF16_ENGINE = {"class_path": "gspo_lightning.engines.HFEngine", "init_args": {"sampling_dtype": "bfloat16"}}
FROM_BF16_SAMPLER = ["--sampler.old_logprobs=engine", f"--sampler.engine={json.dumps(BF16_ENGINE)}"]
VARIANTS = {
    "GSPO, pi_old recomputed (fp32)": ["--model.init_args.objective=gspo"],
    "GSPO, pi_old from bf16 sampler": ["--model.init_args.objective=gspo", *FROM_BF16_SAMPLER],
    "GRPO, pi_old recomputed (fp32)": ["--model.init_args.objective=grpo"],
    "GRPO, pi_old from bf16 sampler": ["--model.init_args.objective=grpo", *FROM_BF16_SAMPLER],
}
COLORS = dict(zip(VARIANTS, ["tab:blue", "tab:cyan", "tab:red", "tab:orange"]))
KEYS = (
    "eval/accuracy", "rollout/reward_mean", "train/clip_frac", "drift/kl_old_theta_mb0",
    "diag/seq_ratio_p05", "diag/seq_ratio_p95", "diag/abs_log_seq_ratio_p95",
)  # fmt: skip


def first_minibatch(row: dict) -> bool:
    """Steps that train on a round's first minibatch (K = 4 in the quick-start config): no update since sampling."""
    return row["step"] % 4 == 0


def summary(curves: list[dict], finished: list[dict]) -> list[dict]:
    rows = []
    for run in finished:
        steps = common.steps_of(curves, run)
        rows.append(run | common.outcome(steps) | {
            "clip_frac_mean": common.mean_of(steps, "train/clip_frac"),
            "mb0_clip_frac": common.mean_of(steps, "train/clip_frac", first_minibatch),
            "mb0_kl_old_theta": common.mean_of(steps, "drift/kl_old_theta_mb0"),
            "mb0_seq_ratio_p05": common.mean_of(steps, "diag/seq_ratio_p05", first_minibatch),
            "mb0_seq_ratio_p95": common.mean_of(steps, "diag/seq_ratio_p95", first_minibatch),
        })  # fmt: skip
    return rows


def plot(curves: list[dict], path: Path) -> None:
    figure, axes = common.grid_figure()
    for name, color in COLORS.items():
        runs = common.runs_of(curves, name)
        common.plot_accuracy_and_reward(axes[0, 0], axes[0, 1], runs, name, color)
        first = [[r for r in run if first_minibatch(r)] for run in runs]
        common.plot_band(axes[1, 0], [([r["step"] for r in f], common.smooth([r["train/clip_frac"] for r in f], 25)) for f in first], name, color)
        spread = [([r["step"] for r in f], common.smooth([r["diag/seq_ratio_p95"] - r["diag/seq_ratio_p05"] for r in f], 25)) for f in first]
        common.plot_band(axes[1, 1], spread, name, color)
        for axis in axes.flat:
            axis.lines[-1].set_linestyle("--" if "bf16" in name else "-")
    common.finish_axes(axes.flat, [
        ("optimizer step", "held-out accuracy (%)"), ("optimizer step", "training reward (moving avg. 50)"),
        ("optimizer step (first minibatch of each round)", "clip fraction from the mismatch alone (moving avg.)"),
        ("optimizer step (first minibatch of each round)", "p95 - p05 of the sequence ratio (moving avg.)"),
    ])  # fmt: skip
    axes[1, 0].set_yscale("symlog", linthresh=1e-4)
    seeds = len({r["seed"] for r in curves})
    common.save_figure(figure, f"pi_old from a bf16 sampling pass vs recomputed in fp32: mean, band = min-max over {seeds} seeds", path)


def main() -> int:
    args = common.parse_arguments(__doc__, [0, 1], 1000)
    flags = ["--evaluation.every_n_steps=100", f"--trainer.max_steps={args.max_steps}"]
    columns = {
        "run": "{run}", "seed": "{seed}", "accuracy start": "{accuracy_start:.1%}", "end": "{accuracy_end:.1%}",
        "best": "{accuracy_best:.1%}", "reward (last 200)": "{reward_last200:.3f}",
        "clip frac at mb0": "{mb0_clip_frac:.2e}", "seq ratio p05-p95 at mb0": "{mb0_seq_ratio_p05:.4f}-{mb0_seq_ratio_p95:.4f}",
    }  # fmt: skip
    common.run_and_report(HERE, VARIANTS, args.seeds, KEYS, flags, summary, plot, "precision.png", columns, args.replot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Claim 4 with long responses: pi_old from a bf16 sampler, with and without the mismatch correction, in training.

    python experiments/precision_long/run.py           # about 22 minutes on 2 CPU cores

The long-response task of ``experiments/long_responses`` at 5 digits (66-token responses; the same warm start,
steps and evaluation), GSPO and GRPO (paper clipping), the sampler (the ``hf`` engine) in bfloat16 or float32:

- ``fp32``: float32 sampler, pi_old recomputed in float32 (the reference: on-policy up to float32 rounding);
- ``bf16, pi_old from sampler``: the bf16 sampler's own log-probs are pi_old (``sampler.old_logprobs: engine``),
  as when an inference engine's likelihoods are used directly: claim 4's setting;
- ``bf16, recomputed + TIS``: the mismatch corrected: pi_old recomputed in float32, and truncated importance
  sampling of the sampler's distribution against it (``model.rollout_correction: {mode: tis, threshold: 2}``),
  per token for GRPO and per sequence for GSPO (the correction needs the recompute).

On a round's first minibatch pi_theta equals the weights that sampled, so there the ratio measures the precision
mismatch alone. Seed 0 (the bf16 sampler runs at half the float32 speed on this CPU, so a second seed did not fit
the time available; the warm start is the long-response experiment's).

Writes beside this file: ``curves.csv``, ``results.csv`` and ``precision_long.png``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

HERE = Path(__file__).parent
long_responses = common.load_script(HERE.parent / "long_responses/run.py")  # its task settings and objectives
first_minibatch = common.load_script(HERE.parent / "precision/run.py").first_minibatch  # K = 4 here too
DIGITS = 5
BF16_ENGINE = {"class_path": "gspo_lightning.engines.HFEngine", "init_args": {"sampling_dtype": "bfloat16"}}
SAMPLERS = {
    "fp32": [],
    "bf16, pi_old from sampler": ["--sampler.old_logprobs=engine", f"--sampler.engine={json.dumps(BF16_ENGINE)}"],
    "bf16, recomputed + TIS": [
        f"--sampler.engine={json.dumps(BF16_ENGINE)}",
        '--model.init_args.rollout_correction={"mode": "tis", "threshold": 2.0}',
    ],
}
NAMES = [f"{objective}, {sampler}" for objective in long_responses.OBJECTIVES for sampler in SAMPLERS]


def variants(steps: int) -> dict[str, list[str]]:
    return {
        f"{objective}, {sampler}": [f"--model.init_args.objective={flag}", *long_responses.length_flags(DIGITS, steps), *flags]
        for objective, flag in long_responses.OBJECTIVES.items()
        for sampler, flags in SAMPLERS.items()
    }


KEYS = (
    "eval/accuracy", "rollout/reward_mean", "train/clip_frac", "diag/seq_ratio_p05", "diag/seq_ratio_p95",
    "drift/kl_old_theta_mb0", "mismatch/kl", "mismatch/log_ratio_p05", "mismatch/log_ratio_p95", "mismatch/truncated_frac",
)  # fmt: skip
COLORS = dict(zip(NAMES, ["tab:blue", "tab:cyan", "tab:green", "tab:red", "tab:orange", "tab:brown"]))


def summary(curves: list[dict], finished: list[dict]) -> list[dict]:
    return common.summarise(curves, finished, {
        "clip_frac_mean": "train/clip_frac",
        "mb0_clip_frac": ("train/clip_frac", first_minibatch),
        "mb0_seq_ratio_p05": ("diag/seq_ratio_p05", first_minibatch),
        "mb0_seq_ratio_p95": ("diag/seq_ratio_p95", first_minibatch),
        "sampler_kl": "mismatch/kl", "sampler_log_ratio_p05": "mismatch/log_ratio_p05",
        "sampler_log_ratio_p95": "mismatch/log_ratio_p95", "tis_truncated_frac": "mismatch/truncated_frac",
    })  # fmt: skip


def plot(curves: list[dict], path: Path) -> None:
    figure, axes = common.grid_figure()
    for name, color in COLORS.items():
        runs = common.runs_of(curves, name)
        if not runs:
            continue
        common.plot_accuracy_and_reward(axes[0, 0], axes[0, 1], runs, name, color)
        first = [[r for r in run if first_minibatch(r)] for run in runs]
        common.plot_band(axes[1, 0], [([r["step"] for r in f], common.smooth([r["train/clip_frac"] for r in f], 10)) for f in first], name, color)
        spread = [([r["step"] for r in f], common.smooth([r["diag/seq_ratio_p95"] - r["diag/seq_ratio_p05"] for r in f], 10)) for f in first]
        common.plot_band(axes[1, 1], spread, name, color)
    common.finish_axes(axes.flat, [
        ("optimizer step", "held-out accuracy (%)"), ("optimizer step", "training reward (moving avg. 50)"),
        ("optimizer step (first minibatch of each round)", "clip fraction (moving avg.)"),
        ("optimizer step (first minibatch of each round)", "p95 - p05 of the sequence ratio (moving avg.)"),
    ])  # fmt: skip
    axes[1, 0].set_yscale("symlog", linthresh=1e-4)
    seeds = len({r["seed"] for r in curves})
    common.save_figure(figure, f"bf16 sampler, {DIGITS}-digit scratchpad addition: mean, band = min-max over {seeds} seeds", path)


def main() -> int:
    args = common.parse_arguments(__doc__, [0], 200)
    columns = {
        "run": "{run}", "seed": "{seed}", "accuracy start": "{accuracy_start:.1%}", "end": "{accuracy_end:.1%}",
        "best": "{accuracy_best:.1%}", "reward (last 200)": "{reward_last200:.3f}", "clip frac": "{clip_frac_mean:.2e}",
        "clip frac at mb0": "{mb0_clip_frac:.2e}", "seq ratio p05-p95 at mb0": "{mb0_seq_ratio_p05:.4f}-{mb0_seq_ratio_p95:.4f}",
        "sampler log-ratio p05 / p95": "{sampler_log_ratio_p05:.1e} / {sampler_log_ratio_p95:.1e}",
        "TIS capped": "{tis_truncated_frac:.1e}",
    }  # fmt: skip
    common.run_and_report(HERE, variants(args.max_steps), args.seeds, KEYS, [], summary, plot, "precision_long.png", columns,
                          args.replot, config=long_responses.CONFIG, seed_flags=long_responses.rl_seed, cache=args.cache)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Issue 41: does GSPO need Rollout Routing Replay (R3) less than GRPO does? GSPO and GRPO on a deep Qwen3-MoE,
each with no replay, Routing Replay against pi_old (R2) and R3, with a bfloat16 sampler under fixed lag 2.

    python experiments/moe_r3/run.py                 # 24 layers, seeds 0-2, 200 steps

The policy is ``experiments/moe_deep``'s (width 64, 8 experts per layer, top-2, warm-started on the quick-start
task), trained with paper clipping, lr 1e-4, P=16 x G=8, K=4. The sampler is the ``hf`` engine in bfloat16
autocast (``sampling_dtype: bfloat16``, standing in for an inference engine in another precision) and rounds are
sampled two policy versions ahead (``asynchronous.mode: fixed_lag``, ``lag: 2``), so the experts that produced a
sample differ from the trainer's pi_old in both precision and weights. Logged per step: clip fraction, mismatch
KL (engine against the trainer's pi_old), how many of the sampler's experts pi_old would replace
(``moe/rollout_vs_old_change_frac``), pi_theta's routing change against the replayed routes, held-out accuracy.

Writes ``curves.csv``, ``results.csv`` and ``moe_r3.png`` beside this file.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

HERE = Path(__file__).parent
WIDTH = 64
moe_routing = common.load_script(HERE.parent / "moe_routing/run.py")

REPLAYS = {"no replay": "off", "R2": "old", "R3": "rollout"}
VARIANTS = {
    f"{objective.upper()}, {label}": [f"--model.init_args.objective={objective}",
                                      f"--model.init_args.routing_replay={replay}"]
    for objective in ("gspo", "grpo")
    for label, replay in REPLAYS.items()
}  # fmt: skip
COLORS = dict(zip(VARIANTS, ["tab:blue", "tab:cyan", "tab:purple", "tab:red", "tab:orange", "tab:brown"]))
KEYS = ("eval/accuracy", "rollout/reward_mean", "train/clip_frac", "mismatch/kl", "moe/rollout_vs_old_change_frac",
        "moe/expert_change_frac", "train/ratio_max")  # fmt: skip


def summary(curves: list[dict], finished: list[dict]) -> list[dict]:
    rows = []
    for run in finished:
        steps = common.steps_of(curves, run)
        rows.append(run | common.outcome(steps) | {
            "clip_frac_mean": common.mean_of(steps, "train/clip_frac"),
            "mismatch_kl_mean": common.mean_of(steps, "mismatch/kl"),
            "rollout_vs_old_mean": common.mean_of(steps, "moe/rollout_vs_old_change_frac"),
            "expert_change_mean": common.mean_of(steps, "moe/expert_change_frac"),
            "ratio_max_max": max(r["train/ratio_max"] for r in steps if not math.isnan(r["train/ratio_max"])),
        })  # fmt: skip
    return rows


def plot(curves: list[dict], path: Path) -> None:
    figure, axes = common.grid_figure()
    for name, color in COLORS.items():
        runs = common.runs_of(curves, name)
        common.plot_accuracy_and_reward(axes[0, 0], axes[0, 1], runs, name, color)
        for axis, key in ((axes[1, 0], "train/clip_frac"), (axes[1, 1], "mismatch/kl")):
            series = [([r["step"] for r in run if not math.isnan(r[key])],
                       common.smooth([r[key] for r in run if not math.isnan(r[key])], 25)) for run in runs]  # fmt: skip
            common.plot_band(axis, series, name, color)
    common.finish_axes(axes.flat, [
        ("optimizer step", "held-out accuracy (%)"), ("optimizer step", "training reward (moving avg. 50)"),
        ("optimizer step", "clip fraction (moving avg. 25)"), ("optimizer step", "mismatch KL (moving avg. 25)"),
    ])  # fmt: skip
    seeds = len({r["seed"] for r in curves})
    common.save_figure(figure, f"Qwen3-MoE, bf16 sampler, fixed lag 2: mean, band = min-max over {seeds} seeds", path)


def main() -> int:
    def depth(parser):
        parser.add_argument("--layers", type=int, default=24, help="decoder layers of the MoE policy")

    args = common.parse_arguments(__doc__, [0, 1, 2], 200, depth)
    flags = [
        "--model.init_args.policy.init_args.base=" + json.dumps(moe_routing.moe_policy(args.layers, WIDTH, heads=2)),
        "--sampler.engine=" + json.dumps({"class_path": "gspo_lightning.engines.HFEngine",
                                          "init_args": {"sampling_dtype": "bfloat16"}}),
        "--sampler.asynchronous.mode=fixed_lag", "--sampler.asynchronous.lag=2",
        f"--evaluation.every_n_steps={max(1, args.max_steps // 4)}", f"--trainer.max_steps={args.max_steps}",
    ]  # fmt: skip
    columns = {
        "run": "{run}", "seed": "{seed}", "accuracy start": "{accuracy_start:.1%}", "end": "{accuracy_end:.1%}",
        "best": "{accuracy_best:.1%}", "clip frac": "{clip_frac_mean:.3f}", "mismatch KL": "{mismatch_kl_mean:.2e}",
        "sampler vs pi_old experts": "{rollout_vs_old_mean:.2%}", "pi_theta vs replayed": "{expert_change_mean:.2%}",
        "max token ratio": "{ratio_max_max:.2f}", "wall s": "{seconds:.0f}",
    }  # fmt: skip
    common.run_and_report(HERE, VARIANTS, args.seeds, KEYS, flags, summary, plot, "moe_r3.png", columns, args.replot,
                          cache=args.cache)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

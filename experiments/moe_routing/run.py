"""Claim 3 at CPU scale: MoE training stability, expert-activation volatility, and Routing Replay.

    python experiments/moe_routing/run.py          # about 35 minutes on 2 CPU cores

A tiny Qwen3-MoE policy (4 layers, 8 experts per layer, top-2 routing, renormalised) is warm-started on the
quick-start task (3-digit addition) like the dense quick start, then trained with the quick-start RL settings
(P=16 x G=8, K=4 minibatches; 1000 steps here) as: GRPO without Routing Replay, GRPO with Routing Replay
(``model.routing_replay: old``), and GSPO without it; seeds 0 and 1. For the same rollout tokens, every
training step logs the fraction of activated experts that pi_theta's routers choose and pi_old's did not, per
layer and per minibatch index k (k optimizer updates after the rollout was sampled).

Writes beside this file: ``curves.csv``, ``results.csv`` (one row per run: accuracy, reward, expert change
after one update, per layer, ratio statistics), and ``moe_routing.png``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

HERE = Path(__file__).parent
LAYERS = 4


def moe_policy(layers: int = LAYERS, width: int = 128, heads: int = 4) -> dict:
    """The warm start's base: a ``TinyQwen3Moe`` with 8 experts per layer, top-2 routing."""
    return {
        "class_path": "gspo_lightning.models.TinyQwen3Moe",
        "init_args": {
            "hidden_size": width, "num_layers": layers, "num_heads": heads, "num_kv_heads": heads // 2,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": width,
        },
    }  # fmt: skip


VARIANTS = {
    "GRPO": ["--model.init_args.objective=grpo"],
    "GRPO + Routing Replay": ["--model.init_args.objective=grpo", "--model.init_args.routing_replay=old"],
    "GSPO": ["--model.init_args.objective=gspo"],
}


def keys(layers: int = LAYERS) -> tuple[str, ...]:
    return (
        "eval/accuracy", "rollout/reward_mean", "train/clip_frac", "diag/abs_log_seq_ratio_p95", "train/ratio_max",
        "moe/expert_change_frac", *(f"moe/expert_change_mb{k}" for k in range(4)),
        *(f"moe/expert_change_frac_layer{layer}" for layer in range(layers)),
    )  # fmt: skip


COLORS = {"GRPO": "tab:red", "GRPO + Routing Replay": "tab:orange", "GSPO": "tab:blue"}


def summary(curves: list[dict], finished: list[dict]) -> list[dict]:
    rows = []
    layers = sum(key.startswith("moe/expert_change_frac_layer") for key in curves[0])
    for run in finished:
        steps = common.steps_of(curves, run)
        row = run | common.outcome(steps) | {
            "expert_change_after_1_update": common.mean_of(steps, "moe/expert_change_mb1"),
            "expert_change_after_3_updates": common.mean_of(steps, "moe/expert_change_mb3"),
            "clip_frac_mean": common.mean_of(steps, "train/clip_frac"),
            "abs_log_seq_ratio_p95_mean": common.mean_of(steps, "diag/abs_log_seq_ratio_p95"),
            "ratio_max_max": max(r["train/ratio_max"] for r in steps if not math.isnan(r["train/ratio_max"])),
        }  # fmt: skip
        for layer in range(layers):
            row[f"expert_change_layer{layer}"] = common.mean_of(steps, f"moe/expert_change_frac_layer{layer}")
        rows.append(row)
    return rows


def plot(curves: list[dict], path: Path, shape: str = "4 layers") -> None:
    figure, axes = common.grid_figure()
    for name, color in COLORS.items():
        runs = common.runs_of(curves, name)
        common.plot_accuracy_and_reward(axes[0, 0], axes[0, 1], runs, name, color)
        after_one = [[r for r in run if not math.isnan(r["moe/expert_change_mb1"])] for run in runs]
        common.plot_band(axes[1, 0], [([r["step"] for r in a], common.smooth([100 * r["moe/expert_change_mb1"] for r in a], 25)) for a in after_one], name, color)
        common.plot_band(axes[1, 1], [([r["step"] for r in run], common.smooth([r["diag/abs_log_seq_ratio_p95"] for r in run], 50)) for run in runs], name, color)
    common.finish_axes(axes.flat, [
        ("optimizer step", "held-out accuracy (%)"), ("optimizer step", "training reward (moving avg. 50)"),
        ("optimizer step", "experts changed after 1 update (%, moving avg.)"),
        ("optimizer step", "p95 of |log sequence ratio| (moving avg. 50)"),
    ])  # fmt: skip
    seeds = len({r["seed"] for r in curves})
    common.save_figure(figure, f"Tiny Qwen3-MoE ({shape}, 8 experts, top-2): mean, band = min-max over {seeds} seeds", path)


def main() -> int:
    args = common.parse_arguments(__doc__, [0, 1], 1000)
    flags = [
        "--model.init_args.policy.init_args.base=" + json.dumps(moe_policy()),
        "--evaluation.every_n_steps=100",
        f"--trainer.max_steps={args.max_steps}",
    ]
    columns = {
        "run": "{run}", "seed": "{seed}", "accuracy start": "{accuracy_start:.1%}", "end": "{accuracy_end:.1%}",
        "best": "{accuracy_best:.1%}", "reward (last 200)": "{reward_last200:.3f}",
        "experts changed after 1 / 3 updates": "{expert_change_after_1_update:.1%} / {expert_change_after_3_updates:.1%}",
        "clip frac": "{clip_frac_mean:.2e}",
    }  # fmt: skip
    common.run_and_report(HERE, VARIANTS, args.seeds, keys(), flags, summary, plot, "moe_routing.png", columns, args.replot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

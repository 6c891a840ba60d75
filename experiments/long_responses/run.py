"""Claims 1 and 2 with long responses: GSPO vs GRPO on additions written out digit by digit, at two lengths.

    python experiments/long_responses/run.py           # about 60 minutes on 2 CPU cores

``configs/scratchpad.yaml``: a tiny Qwen3 warm-started on scratchpad addition (``ScratchpadAdditionTask``;
each line rewrites the remaining operands, the carry and the result so far, and only the final answer is
scored), P=16 prompts x G=8 responses, K=4 minibatches, temperature 1. Correct responses are 66 tokens at 5
digits and 141 tokens at 8 digits, against 4-8 in the quick start. GSPO (eps 3e-4 / 4e-4 on the sequence
ratio) and GRPO (0.2 / 0.27 on the token ratio), the same rollout budget, seeds 0, 1, 2 (the RL seed and the
prompt stream; one warm start per length, shared by every run of that length, so the seeds compare the
objectives from the same start), held-out greedy accuracy on 128 problems.

Writes beside this file: ``curves.csv``, ``results.csv`` and ``long_responses.png``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

from gspo_lightning.data.scratchpad import scratchpad_length  # noqa: E402

HERE = Path(__file__).parent
CONFIG = common.ROOT / "configs/scratchpad.yaml"
DIGITS = (5, 8)  # operand digits
OBJECTIVES = {"GSPO": "gspo", "GRPO": "grpo"}
KEYS = (
    "eval/accuracy", "rollout/reward_mean", "train/clip_frac", "rollout/response_len_mean",
    "diag/abs_log_seq_ratio_p95", "train/ratio_max", "rollout/zero_variance_frac",
)  # fmt: skip
COLORS = {"GSPO": "tab:blue", "GRPO": "tab:red"}


def length_flags(digits: int, steps: int) -> list[str]:
    """The task, the warm start and the response budget at ``digits`` digits (room for a final carry and eos),
    ``steps`` optimizer steps and 8 evaluations."""
    return [
        f"--model.init_args.policy.init_args.num_digits={digits}",
        f"--data.init_args.source.init_args.num_digits={digits}",
        f"--sampler.max_new_tokens={scratchpad_length(digits) + 2}",
        f"--trainer.max_steps={steps}",
        f"--evaluation.every_n_steps={max(1, steps // 8)}",
    ]


def variant_name(objective: str, digits: int) -> str:
    return f"{objective}, {digits} digits ({scratchpad_length(digits)} tokens)"


def variants(steps: int) -> dict[str, list[str]]:
    return {
        variant_name(objective, digits): [f"--model.init_args.objective={flag}", *length_flags(digits, steps)]
        for digits in DIGITS
        for objective, flag in OBJECTIVES.items()
    }


def rl_seed(seed: int) -> list[str]:
    """The RL run's seed and the prompt stream's; the warm start keeps its default seed (shared per length)."""
    return [f"--seed_everything={seed}", f"--data.init_args.seed={seed}"]


def summary(curves: list[dict], finished: list[dict]) -> list[dict]:
    rows = []
    for run in finished:
        steps = common.steps_of(curves, run)
        rows.append(run | common.outcome(steps) | {
            "train_seconds": steps[-1]["train_seconds"],
            "clip_frac_mean": common.mean_of(steps, "train/clip_frac"),
            "response_len_mean": common.mean_of(steps, "rollout/response_len_mean"),
            "abs_log_seq_ratio_p95_mean": common.mean_of(steps, "diag/abs_log_seq_ratio_p95"),
            "zero_variance_frac": common.mean_of(steps, "rollout/zero_variance_frac"),
        })  # fmt: skip
    return rows


def plot(curves: list[dict], path: Path) -> None:
    figure, axes = common.grid_figure(2, len(DIGITS), (6 * len(DIGITS), 8.5))
    for column, digits in enumerate(DIGITS):
        for objective, color in COLORS.items():
            name = variant_name(objective, digits)
            runs = common.runs_of(curves, name)
            if not runs:
                continue
            evaluated = [[r for r in run if not math.isnan(r["eval/accuracy"])] for run in runs]
            common.plot_band(axes[0, column], [([r["step"] for r in e], [100 * r["eval/accuracy"] for r in e]) for e in evaluated], objective, color)
            common.plot_band(axes[1, column], [([r["train_seconds"] for r in e], [100 * r["eval/accuracy"] for r in e]) for e in evaluated], objective, color)
        axes[0, column].set_title(f"{digits} digits: correct responses of {scratchpad_length(digits)} tokens")
    common.finish_axes(axes.flat, [("optimizer step", "held-out accuracy (%)")] * len(DIGITS) + [("training seconds", "held-out accuracy (%)")] * len(DIGITS))
    seeds = len({r["seed"] for r in curves})
    common.save_figure(figure, f"GSPO vs GRPO with long responses: mean, band = min-max over {seeds} seeds", path)


def main() -> int:
    args = common.parse_arguments(__doc__, [0, 1, 2], 200)
    columns = {
        "run": "{run}", "seed": "{seed}", "accuracy start": "{accuracy_start:.1%}", "end": "{accuracy_end:.1%}",
        "best": "{accuracy_best:.1%}", "reward (last 200)": "{reward_last200:.3f}", "clip frac": "{clip_frac_mean:.2e}",
        "response tokens": "{response_len_mean:.1f}", "train s": "{train_seconds:.0f}", "wall s": "{seconds:.0f}",
    }  # fmt: skip
    common.run_and_report(HERE, variants(args.max_steps), args.seeds, KEYS, [], summary, plot, "long_responses.png", columns,
                          args.replot, config=CONFIG, seed_flags=rl_seed, cache=args.cache)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

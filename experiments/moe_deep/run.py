"""Claim 3 on a deep MoE: GRPO, GRPO + Routing Replay and GSPO trained on a 24- or 48-layer Qwen3-MoE.

    python experiments/moe_deep/run.py --layers 24     # about 10 minutes on 2 CPU cores (committed)
    python experiments/moe_deep/run.py --layers 48     # the paper's depth: about 19 minutes (committed)

``experiments/moe_depth`` found that one update changes ~12% of the activated experts of a 24-layer MoE with
random routers at lr 1e-4 (the paper: ~10% at 48 layers), against ~5% at 4 layers. This trains that shape
(width 64, 8 experts per layer, top-2) as ``experiments/moe_routing`` trains the 4-layer one: warm-started on the
quick-start task, then GRPO without Routing Replay, GRPO with it and GSPO, paper clipping, lr 1e-4, P=16 x G=8,
K=4 minibatches; 200 steps, seed 0.

Writes into ``<layers>_layers/`` beside this file: ``curves.csv``, ``results.csv``, ``moe_deep.png``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

HERE = Path(__file__).parent
WIDTH = 64
moe_routing = common.load_script(HERE.parent / "moe_routing/run.py")


def main() -> int:
    def depth(parser):
        parser.add_argument("--layers", type=int, default=24, help="decoder layers of the MoE policy")

    args = common.parse_arguments(__doc__, [0], 200, depth)
    layers, out = args.layers, HERE / f"{args.layers}_layers"
    out.mkdir(exist_ok=True)
    flags = [
        "--model.init_args.policy.init_args.base=" + json.dumps(moe_routing.moe_policy(layers, WIDTH, heads=2)),
        f"--evaluation.every_n_steps={max(1, args.max_steps // 4)}",
        f"--trainer.max_steps={args.max_steps}",
    ]
    columns = {
        "run": "{run}", "seed": "{seed}", "accuracy start": "{accuracy_start:.1%}", "end": "{accuracy_end:.1%}",
        "best": "{accuracy_best:.1%}", "reward (last 200)": "{reward_last200:.3f}",
        "experts changed after 1 / 3 updates": "{expert_change_after_1_update:.1%} / {expert_change_after_3_updates:.1%}",
        "clip frac": "{clip_frac_mean:.2e}", "max token ratio": "{ratio_max_max:.2f}", "wall s": "{seconds:.0f}",
    }  # fmt: skip

    def plot(curves, path):
        moe_routing.plot(curves, path, shape=f"{layers} layers, width {WIDTH}")

    common.run_and_report(out, moe_routing.VARIANTS, args.seeds, moe_routing.keys(layers), flags, moe_routing.summary,
                          plot, "moe_deep.png", columns, args.replot, cache=args.cache)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Time and peak memory per optimizer step as the group size G, max_new_tokens and the model width grow.

    python experiments/bench/scaling.py              # about 6 minutes on 2 CPU cores

For sizing runs: ``python -m gspo_lightning fit -c configs/quickstart.yaml`` (P=16 prompts, K=4 minibatches, GSPO)
with a randomly initialised ``TinyQwen3`` (4 layers, MLP 4x the width), changing one setting at a time from
G=8, max_new_tokens=32, width 128. A random model ends its responses at random EOS tokens: the table gives
the mean response length next to each figure. Each point is one run in a fresh process, timed like
``overhead.py`` (mean seconds per optimizer step over whole rounds after warm-up rounds, every K-th step
sampling); ``generate s / round`` is the sampler's own timer, ``peak RSS`` the process's peak resident memory
during the timed steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from experiments.bench.bare_loop import QUICKSTART  # noqa: E402
from experiments.bench.overhead import machine_info  # noqa: E402
from experiments.common import run_fit  # noqa: E402

BASE = {"group_size": 8, "max_new_tokens": 32, "width": 128}
SWEEPS = {"group_size": [4, 8, 16, 32], "max_new_tokens": [16, 32, 64, 128], "width": [64, 128, 256, 512]}
K = 4  # the quick start's minibatches per rollout


def overrides(point: dict[str, int], warmup_steps: int, steps: int, output: Path) -> list[str]:
    width = point["width"]
    policy = {
        "class_path": "gspo_lightning.models.TinyQwen3",
        "init_args": {"hidden_size": width, "intermediate_size": 4 * width, "max_position_embeddings": 256},
    }
    return [
        f"--model.init_args.policy={json.dumps(policy)}",
        f"--sampler.group_size={point['group_size']}",
        f"--model.init_args.max_new_tokens={point['max_new_tokens']}",
        f"--trainer.max_steps={warmup_steps + steps}",
        "--evaluation.at_start=false",
        "--evaluation.at_end=false",
        "--evaluation.every_n_steps=0",
        "--export.enabled=false",
        "--trainer.callbacks+=experiments.bench.overhead.StepTimer",
        f"--trainer.callbacks.warmup_steps={warmup_steps}",
        f"--trainer.callbacks.steps={steps}",
        f"--trainer.callbacks.output={output}",
    ]


def measure(point: dict[str, int], args: argparse.Namespace, scratch: Path) -> dict[str, float]:
    workdir = scratch / "-".join(f"{k}{v}" for k, v in point.items())
    output = workdir / "timer.json"
    finished = run_fit(workdir, overrides(point, args.warmup_steps, args.steps, output), scratch / "cache", QUICKSTART)
    timer = json.loads(output.read_text())
    timed = [values for step, values in finished["steps"].items() if step >= args.warmup_steps]
    rounds = [values["time/generate_s"] for values in timed if values.get("time/generate_s", 0.0) > 0]
    return {
        "seconds_per_step": timer["seconds_per_step"],
        "generate_s_per_round": statistics.fmean(rounds),
        "response_len": statistics.fmean(values["rollout/response_len_mean"] for values in timed),
        "peak_mib": timer["window_peak_mib"],
    }


def points() -> list[tuple[str, dict[str, int]]]:
    """The base point once, then each sweep's other values."""
    planned = [("base", dict(BASE))]
    for name, values in SWEEPS.items():
        planned += [(name, BASE | {name: value}) for value in values if value != BASE[name]]
    return planned


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="timed optimizer steps per point (multiple of K=4)")
    parser.add_argument("--warmup-steps", type=int, default=4, help="untimed steps first (multiple of K=4)")
    args = parser.parse_args()
    if args.steps % K or args.warmup_steps % K or args.warmup_steps < K:
        parser.error(f"--steps and --warmup-steps must be multiples of K={K}, --warmup-steps >= K")
    results = {}
    with tempfile.TemporaryDirectory(prefix="gspo-scaling-") as scratch:
        for sweep, point in points():
            results[tuple(point.values())] = measure(point, args, Path(scratch))
            print(f"{sweep} {point}: {results[tuple(point.values())]}", flush=True)
    print(f"\n{machine_info()}\nP=16 prompts, K={K}, GSPO; {args.steps} timed steps after {args.warmup_steps}\n")
    print("| G | max_new_tokens | width | s / optimizer step | generate s / round | mean response tokens | peak RSS (MiB) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in SWEEPS:  # one block per sweep, the base point in each
        for key, result in sorted(results.items(), key=lambda item: item[0][list(BASE).index(name)]):
            if any(value != BASE[other] for other, value in zip(BASE, key) if other != name):
                continue
            print(f"| {key[0]} | {key[1]} | {key[2]} | {result['seconds_per_step']:.3f} | "
                  f"{result['generate_s_per_round']:.3f} | {result['response_len']:.1f} | {result['peak_mib']:.0f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

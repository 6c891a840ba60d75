"""Framework overhead: gspo_lightning's time and memory per optimizer step against a bare PyTorch loop.

    python experiments/bench/overhead.py                      # 5-6 minutes on 2 CPU cores
    python experiments/bench/overhead.py --reps 1 --steps 8   # a smoke run
    python experiments/bench/overhead.py --policy tiny        # a random TinyQwen3 (all rewards 0) on both sides

Both sides run ``configs/quickstart.yaml`` (the warm-started tiny Qwen3 on 3-digit addition, P=16, G=8, K=4,
max_new_tokens=8, GSPO, AdamW lr 1e-4 with 10 warm-up steps, gradient clipping 1.0), each in a fresh process:

- ``gspo_lightning``: ``python -m gspo_lightning fit -c configs/quickstart.yaml`` itself, with ``max_steps`` =
  warm-up + timed steps, the held-out evaluation (step 0, every 250 steps, end) and the export at the end
  turned off, the progress bar off, and a ``StepTimer`` callback (below) added. Kept as configured: the CSV
  logger (``log_every_n_steps: 1``), the learning-rate monitor, the ModelCheckpoint (every 250 steps; it does
  not fire inside a window of fewer than 250 steps, so the cost of one save is reported on its own), the
  sampler's per-step metrics, the non-finite guard.
- ``bare loop``: ``experiments/bench/bare_loop.py``, the same work with the package's functions and no Lightning.

Timed region, the same on both sides: wall time from the end of optimizer step ``--warmup-steps`` - 1 to the
end of the last step, divided by ``--steps`` (a multiple of K, so whole rounds: every K-th step samples).
Peak memory: VmHWM (peak RSS) reset through /proc/self/clear_refs when the window opens and read when it
closes; the process peak up to then is reported too. Each repetition runs both sides one after the other,
alternating which goes first, with the same torch thread count (``--threads``, set by OMP_NUM_THREADS).
Same seed, same draws, same math: the two sides' per-step losses are compared, and should be bitwise equal.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
import transformers
from lightning.pytorch.callbacks import Callback

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from experiments.bench.bare_loop import QUICKSTART, StepWindow, with_defaults  # noqa: E402
from experiments.common import run_fit  # noqa: E402
from gspo_lightning.cli import composed_config  # noqa: E402
from gspo_lightning.sampling import GroupSampler  # noqa: E402
from gspo_lightning.models.warm_start import cache_root  # noqa: E402

BARE_LOOP = ROOT / "experiments/bench/bare_loop.py"
SIDES = ("bare", "lightning")
LIMIT = 1.1  # the bound on both ratios


class StepTimer(Callback):
    """Times the optimizer steps of a Lightning run with :class:`StepWindow`; writes the result as JSON.

    Added with ``--trainer.callbacks+=`` (Lightning runs it before the CLI's own callbacks and the checkpoint);
    its ``on_train_batch_end`` runs at the same point of every step, so the window holds every hook, log and
    save of its steps wherever in the step that point is.
    At the end it also times one ``save_checkpoint``, the cost ModelCheckpoint pays every n steps.
    """

    def __init__(self, warmup_steps: int, steps: int, output: str) -> None:
        self.window = StepWindow(warmup_steps, steps)
        self.output = Path(output)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.window.end_of_step(batch_idx)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        started = time.perf_counter()
        trainer.save_checkpoint(self.output.with_suffix(".ckpt"))
        checkpoint_s = time.perf_counter() - started
        self.output.write_text(json.dumps({"side": "lightning", "checkpoint_s": checkpoint_s} | self.window.result))


def lightning_overrides(args: argparse.Namespace, output: Path) -> list[str]:
    """Command-line overrides of the quick-start config: the same work as the bare loop, plus the timer."""
    overrides = [
        f"--trainer.max_steps={args.warmup_steps + args.steps}",
        "--evaluation.at_start=false",
        "--evaluation.at_end=false",
        "--evaluation.every_n_steps=0",
        "--export.enabled=false",
        "--trainer.callbacks+=experiments.bench.overhead.StepTimer",
        f"--trainer.callbacks.warmup_steps={args.warmup_steps}",
        f"--trainer.callbacks.steps={args.steps}",
        f"--trainer.callbacks.output={output}",
    ]
    if args.policy == "tiny":
        overrides.append("--model.init_args.policy=gspo_lightning.models.TinyQwen3")
    return overrides


def run_lightning(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    output = workdir / "timer.json"
    finished = run_fit(workdir, lightning_overrides(args, output), args.cache, QUICKSTART)
    result = json.loads(output.read_text())
    steps = finished["steps"]  # the CSV logger's per-step metrics: the same work check as the bare loop's
    timed = [values for step, values in steps.items() if step >= args.warmup_steps]
    result["losses"] = [steps[step].get("train/loss", float("nan")) for step in sorted(steps)]
    for key in ("reward_mean", "response_len_mean"):
        result[key] = statistics.fmean(values[f"rollout/{key}"] for values in timed)
    return result


def run_bare(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    output = workdir / "bare.json"
    command = [sys.executable, str(BARE_LOOP), "--output", str(output), "--policy", _bare_policy(args)]
    command += ["--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps)]
    _run(command, workdir, args)
    return json.loads(output.read_text())


def prepare(args: argparse.Namespace, workdir: Path) -> None:
    """Build the policy once before any timed run, so a first-use warm start is in no run's memory or time."""
    workdir.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, str(BARE_LOOP), "--prepare", "--policy", _bare_policy(args)], workdir, args)


def _bare_policy(args: argparse.Namespace) -> str:
    return "tiny" if args.policy == "tiny" else "config"


def _run(command: list[str], workdir: Path, args: argparse.Namespace) -> None:
    environment = dict(os.environ, GSPO_LIGHTNING_CACHE=str(args.cache), PYTHONPATH=str(ROOT))
    result = subprocess.run(command, cwd=workdir, env=environment, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-4000:]}")


def measure(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """``--reps`` results per side, the two sides taking turns at going first."""
    results: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    runners = {"bare": run_bare, "lightning": run_lightning}
    with tempfile.TemporaryDirectory(prefix="gspo-overhead-") as scratch:
        prepare(args, Path(scratch) / "prepare")
        for rep in range(args.reps):
            for side in SIDES if rep % 2 == 0 else SIDES[::-1]:
                results[side].append(runners[side](args, Path(scratch) / f"{side}-{rep}"))
                print(f"rep {rep} {side}: {results[side][-1]['seconds_per_step']:.4f} s/step", flush=True)
    return results


def _spread(values: list[float], digits: int) -> str:
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


METRICS = {
    "s / optimizer step": ("seconds_per_step", 4),
    "peak RSS in window (MiB)": ("window_peak_mib", 0),
    "process peak RSS (MiB)": ("process_peak_mib", 0),
    "RSS when window opens (MiB)": ("rss_at_open_mib", 0),
}


def median_ratio(results: dict[str, list[dict[str, Any]]], key: str) -> float:
    """lightning / bare of the medians over reps."""
    medians = {side: statistics.median(r[key] for r in results[side]) for side in SIDES}
    return medians["lightning"] / medians["bare"]


def table(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Markdown: median [min-max] per side, and lightning / bare as the ratio of medians [min-max of pairs]."""
    lines = ["| | " + " | ".join(METRICS) + " |", "| --- |" + " --- |" * len(METRICS)]
    for side, name in (("bare", "bare PyTorch loop"), ("lightning", "gspo_lightning")):
        cells = [_spread([r[key] for r in results[side]], digits) for key, digits in METRICS.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    ratios = []
    for key, _ in METRICS.values():
        # Rep i of each side ran back to back, so their ratio cancels slow drifts in the machine's load.
        pairs = [light[key] / bare[key] for light, bare in zip(results["lightning"], results["bare"])]
        ratios.append(f"**{median_ratio(results, key):.3f}x** [{min(pairs):.3f}-{max(pairs):.3f}]")
    lines.append("| lightning / bare | " + " | ".join(ratios) + " |")
    lines.append("\nmedian [min-max] over reps; ratio row: ratio of the medians [min-max of the per-rep ratios]")
    return lines


def verdict(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The issue's two bounds, and the checks that both sides did the same work."""
    lines = []
    for label, key in (("time per optimizer step", "seconds_per_step"), ("peak RSS in window", "window_peak_mib")):
        ratio = median_ratio(results, key)
        lines.append(f"- {label}: {ratio:.3f}x, {'within' if ratio <= LIMIT else 'ABOVE'} the {LIMIT}x bound")
    for side in SIDES:
        runs = results[side]
        lines.append(
            f"- {side}: torch threads {sorted({r['threads'] for r in runs})}, timed rounds' mean reward "
            f"{statistics.fmean(r['reward_mean'] for r in runs):.3f}, mean response length "
            f"{statistics.fmean(r['response_len_mean'] for r in runs):.2f} tokens"
        )
    if not any(r["nonzero_advantage_rounds"] for r in results["bare"]):
        lines.append("- every group's rewards were equal: all advantages 0 (the loss and its backward ran anyway)")
    # Same seed, same draws, same math: losses equal bit for bit show that both sides did the same work.
    pairs = zip(results["bare"], results["lightning"])
    gap = max(abs(x - y) for bare, light in pairs for x, y in zip(bare["losses"], light["losses"], strict=True))
    same = "bitwise identical" if gap == 0 else f"apart by up to {gap:.2e}"
    lines.append(f"- per-step losses of the two sides (every step of every rep): {same}")
    saves = [r["checkpoint_s"] for r in results["lightning"]]
    every = checkpoint_interval()
    lines.append(
        f"- one ModelCheckpoint save (outside the window): {_spread(saves, 3)} s, i.e. "
        f"{statistics.median(saves) / every:.5f} s per step at every_n_train_steps={every}"
    )
    return lines


def checkpoint_interval() -> int:
    """every_n_train_steps of the quick-start config's ModelCheckpoint."""
    callbacks = composed_config(QUICKSTART)["trainer"]["callbacks"]
    spec = next(c for c in callbacks if c["class_path"].endswith(".ModelCheckpoint"))
    return spec["init_args"]["every_n_train_steps"]


def machine_info() -> str:
    return (
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"torch.get_num_threads() {torch.get_num_threads()}, lightning {lightning.__version__}, "
        f"transformers {transformers.__version__}, Python {platform.python_version()}"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=9, help="runs of each side")
    parser.add_argument("--steps", type=int, default=120, help="timed optimizer steps per run (multiple of K)")
    parser.add_argument("--warmup-steps", type=int, default=8, help="untimed steps first (multiple of K, >= K)")
    parser.add_argument("--policy", choices=("warm", "tiny"), default="warm", help="tiny: random TinyQwen3")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads, both sides")
    parser.add_argument("--cache", type=Path, default=cache_root(), help="warm-start cache (GSPO_LIGHTNING_CACHE)")
    args = parser.parse_args()
    minibatches = with_defaults(GroupSampler, composed_config(QUICKSTART)["sampler"])["num_minibatches"]  # K
    if args.steps % minibatches or args.warmup_steps % minibatches or args.warmup_steps < minibatches:
        parser.error(f"--steps and --warmup-steps must be multiples of K={minibatches}, --warmup-steps >= K")
    return args


def main() -> None:
    args = parse_args()
    # Set here, read by both children at start-up: torch's intra-op pool size follows OMP_NUM_THREADS.
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    results = measure(args)
    print(f"\n{machine_info()}")
    print(f"{args.reps} reps x {args.steps} timed steps after {args.warmup_steps} warm-up steps, policy {args.policy}")
    print("\n".join(["", *table(results), "", *verdict(results)]))


if __name__ == "__main__":
    main()

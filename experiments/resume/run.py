"""Exact resume on the full quick-start config: SIGKILL mid-rollout, ``--ckpt_path last``, compare step by step.

    python experiments/resume/run.py [--steps 300 --kill-at 270 --checkpoint-every 250]

Runs ``configs/quickstart.yaml`` (the warm-started policy, seed 0, shortened to ``--steps``) three times in a
scratch directory: uninterrupted; killed with SIGKILL at the start of step ``--kill-at``; resumed from the
last checkpoint. Prints how many per-step values (loss, reward, ratio, clip fraction) of the resumed run are
bitwise equal to the uninterrupted run's, and exits non-zero unless all are. The warm start is trained once
and shared by the three runs (cache in the scratch directory).
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gspo_lightning.cli import composed_config  # noqa: E402

COMPARED = ("train/loss", "rollout/reward_mean", "train/ratio_mean", "train/clip_frac")


def write_config(directory: Path, steps: int, checkpoint_every: int, kill_at: int | None) -> Path:
    config = composed_config(ROOT / "configs/quickstart.yaml")
    config["trainer"]["max_steps"] = steps
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(directory / "runs")
    config["trainer"]["callbacks"][0]["init_args"].update(
        dirpath=str(directory / "checkpoints"), every_n_train_steps=checkpoint_every
    )
    if kill_at is not None:
        killer = {"class_path": "tests.fault_helpers.KillAtStep", "init_args": {"step": kill_at}}
        config["trainer"]["callbacks"].append(killer)
    path = directory / ("faulty.yaml" if kill_at is not None else "config.yaml")
    path.write_text(yaml.safe_dump(config))
    return path


def fit(config: Path, cache: Path, *extra: str) -> int:
    command = [sys.executable, "-m", "gspo_lightning", "fit", "-c", str(config), "--trainer.enable_progress_bar=false", *extra]
    environment = dict(os.environ, PYTHONPATH=str(ROOT), GSPO_LIGHTNING_CACHE=str(cache))
    return subprocess.run(command, cwd=config.parent, env=environment, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode


def per_step(run_dir: Path) -> dict[int, tuple[str, ...]]:
    rows = csv.DictReader((run_dir / "metrics.csv").open())
    return {int(r["step"]): tuple(r[k] for k in COMPARED) for r in rows if r["train/loss"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kill-at", type=int, default=270)
    parser.add_argument("--checkpoint-every", type=int, default=250)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="resume-") as scratch:
        root = Path(scratch)
        reference, faulty, cache = root / "reference", root / "faulty", root / "cache"
        reference.mkdir()
        faulty.mkdir()
        assert fit(write_config(reference, args.steps, args.checkpoint_every, None), cache) == 0
        assert fit(write_config(faulty, args.steps, args.checkpoint_every, args.kill_at), cache) == -9
        config = write_config(faulty, args.steps, args.checkpoint_every, None)
        assert fit(config, cache, "--ckpt_path=last", "--trainer.logger.init_args.version=1") == 0
        expected = per_step(reference / "runs/quickstart/version_0")
        resumed = per_step(faulty / "runs/quickstart/version_1")
    equal = sum(expected[step] == values for step, values in resumed.items())
    first = min(resumed)
    print(f"killed at step {args.kill_at} (SIGKILL), resumed from step {first} (minibatch {first % 4} of a round)")
    print(f"steps {first}..{max(resumed)}: {equal}/{len(resumed)} bitwise equal to the uninterrupted run "
          f"on {', '.join(COMPARED)}")
    return 0 if equal == len(resumed) == args.steps - first else 1


if __name__ == "__main__":
    raise SystemExit(main())

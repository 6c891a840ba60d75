"""Fault test: a run killed with SIGKILL mid-rollout and resumed equals an uninterrupted run, step for step."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_cli import ROOT, tiny_run_config

STEPS, CHECKPOINT_EVERY, KILL_AT = 24, 5, 14  # the last checkpoint (step 10) falls inside a round of K = 4
COMPARED = ("train/loss", "rollout/reward_mean", "train/ratio_mean", "train/clip_frac")


def _run(config: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "gspo_lightning", "fit", "-c", str(config), *extra]
    environment = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(command, capture_output=True, text=True, cwd=config.parent, env=environment)


def _per_step(run_dir: Path) -> dict[int, dict[str, str]]:
    rows = csv.DictReader((run_dir / "metrics.csv").open())
    return {int(r["step"]): {k: r[k] for k in COMPARED} for r in rows if r["train/loss"]}


def _config(tmp_path: Path, kill: bool) -> Path:
    sections = {"sampler": {"rewards": ["tests.fault_helpers.length_reward"]}}
    if kill:
        killer = {"class_path": "tests.fault_helpers.KillAtStep", "init_args": {"step": KILL_AT}}
        sections["trainer"] = {"callbacks": [killer]}
    tmp_path.mkdir(exist_ok=True)
    return tiny_run_config(tmp_path, STEPS, checkpoint_every=CHECKPOINT_EVERY, extra=sections)


@pytest.mark.slow
def test_sigkill_mid_rollout_then_resume_matches_an_uninterrupted_run(tmp_path):
    reference = _run(_config(tmp_path / "reference", kill=False))
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = _per_step(tmp_path / "reference/runs/tiny/version_0")

    killed = _run(_config(tmp_path / "faulty", kill=True))
    assert killed.returncode == -signal.SIGKILL
    # Resume with the same config minus the killer, as a user would after a crash.
    resumed = _run(_config(tmp_path / "faulty", kill=False), "--ckpt_path=last", "--trainer.logger.init_args.version=1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = _per_step(tmp_path / "faulty/runs/tiny/version_1")

    resumed_from = min(after)
    assert resumed_from == 10 and resumed_from % 4 != 0  # resumed inside a rollout batch
    assert set(after) == set(range(resumed_from, STEPS))
    assert {step: expected[step] for step in after} == after  # bitwise: the CSV holds full-precision reprs
    assert len({row["train/loss"] for row in after.values()}) > 1  # a real, changing signal was compared

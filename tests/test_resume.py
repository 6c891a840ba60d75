"""Fault tests: a run killed mid-rollout (SIGKILL) or pre-empted (SIGTERM) and resumed with ``--ckpt_path last``
equals an uninterrupted run, step for step and bit for bit."""

from __future__ import annotations

import csv
import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.test_cli import ROOT, tiny_run_config

STEPS, K = 24, 4
COMPARED = ("train/loss", "rollout/reward_mean", "train/ratio_mean", "train/clip_frac")


def _run(config: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "gspo_lightning", "fit", "-c", str(config), *extra]
    environment = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(command, capture_output=True, text=True, cwd=config.parent, env=environment)


def _per_step(run_dir: Path) -> dict[int, dict[str, str]]:
    rows = csv.DictReader((run_dir / "metrics.csv").open())
    return {int(r["step"]): {k: r[k] for k in COMPARED} for r in rows if r["train/loss"]}


def _config(
    directory: Path, checkpoint_every: int, fault: dict | None = None, steps: int = STEPS, own_layout: bool = False
) -> Path:
    sections = {"sampler": {"rewards": ["tests.fault_helpers.length_reward"]}}
    if fault:
        sections["trainer"] = {"callbacks": [fault]}
    directory.mkdir(exist_ok=True)
    return tiny_run_config(directory, steps, checkpoint_every, sections, own_layout)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, dict[str, str]]:
    directory = tmp_path_factory.mktemp("reference")
    result = _run(_config(directory, checkpoint_every=5))
    assert result.returncode == 0, result.stderr[-3000:]
    return _per_step(directory / "runs/tiny/version_0")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "at_step", "checkpoint_every", "exit_code", "resumed_from"),
    [
        # SIGKILL at step 14: the last periodic checkpoint (step 10) is inside a round of K = 4.
        ("KillAtStep", 14, 5, -signal.SIGKILL, 10),
        # SIGTERM at step 5: Lightning finishes that step, CheckpointOnPreemption saves last.ckpt at step 6 and
        # Lightning exits through SIGTERMException (a SystemExit, status 0).
        ("TermAtStep", 5, 100, 0, 6),
        # Ctrl-C at step 5: the same path (gspo_lightning.interrupt), then the summary and exit status 130.
        ("InterruptAtStep", 5, 100, 130, 6),
    ],
)
def test_resumed_run_equals_an_uninterrupted_run(
    tmp_path, uninterrupted, fault, at_step, checkpoint_every, exit_code, resumed_from
):
    """As the README says: the same command with ``--ckpt_path last``, on the config's own layout (checkpoints in
    ``runs/tiny/version_0/checkpoints``); the resumed run continues that folder's ``metrics.csv``."""
    killer = {"class_path": f"tests.fault_helpers.{fault}", "init_args": {"step": at_step}}
    config = _config(tmp_path, checkpoint_every, killer, own_layout=True)
    interrupted = _run(config)
    assert interrupted.returncode == exit_code, interrupted.stderr[-3000:]
    run_dir = tmp_path / "runs/tiny/version_0"
    assert (run_dir / "checkpoints/last.ckpt").exists()
    killed_at = max(_per_step(run_dir))
    if fault == "InterruptAtStep":  # what the console says: where it stopped, the checkpoint, how to resume
        lines = interrupted.stdout.splitlines()
        assert f"=== gspo_lightning run summary: stopped by Ctrl-C at step {resumed_from} ===" in lines
        assert f"optimizer steps: {resumed_from} of {STEPS}" in interrupted.stdout
        assert "last checkpoint: runs/tiny/version_0/checkpoints/last.ckpt" in lines
        assert f"resume with: python -m gspo_lightning fit -c {shlex.quote(str(config))} --ckpt_path last" in lines
    assert killed_at >= at_step - 1  # the kill lost no row logged before it (rows are written as logged)
    # Resume with the same config minus the fault, as a user would.
    resumed = _run(_config(tmp_path, checkpoint_every, own_layout=True), "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.startswith(f"step {resumed_from + 1}/{STEPS}  ")  # counted from the resumed step
    assert "Restoring states from the checkpoint path at runs/tiny/version_0/checkpoints/last.ckpt" in resumed.stderr
    assert sorted(path.name for path in (tmp_path / "runs/tiny").iterdir()) == ["version_0"]  # one run, one folder
    # the resumed run's last checkpoint replaced the one it resumed from: a later --ckpt_path last finds the newest
    assert not (run_dir / "checkpoints/last-v1.ckpt").exists()
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    steps = [int(row["step"]) for row in rows if row["train/loss"]]
    assert steps == list(range(STEPS))  # every step once: the resumed run replaced what the kill left after its checkpoint
    after = {step: row for step, row in _per_step(run_dir).items() if step >= resumed_from}
    assert resumed_from % K != 0  # resumed inside a rollout batch
    assert {step: uninterrupted[step] for step in after} == after  # bitwise: the CSV holds full-precision reprs
    assert len({row["train/loss"] for row in after.values()}) > 1  # a real, changing signal was compared


MULTI_RANK = {
    "ddp": "ddp",
    "fsdp2": json.dumps({"class_path": "gspo_lightning.strategies.DecoderLayerFSDP2"}),
    "fsdp1": json.dumps({"class_path": "gspo_lightning.strategies.DecoderLayerFSDP"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", sorted(MULTI_RANK))
def test_two_rank_resume_restores_every_ranks_round(tmp_path, strategy):
    """Each rank samples its own prompts: its partly consumed round and generators must come back to it; under
    FSDP the checkpoint is sharded (one file per rank) and still resumes bit for bit."""
    steps = 12
    config = _config(tmp_path, checkpoint_every=5, steps=steps)
    settings = yaml.safe_load(config.read_text())
    settings["trainer"]["callbacks"][0]["init_args"]["save_top_k"] = -1  # keep the mid-round step-5 checkpoint
    config.write_text(yaml.safe_dump(settings))
    two_ranks = (f"--trainer.strategy={MULTI_RANK[strategy]}", "--trainer.devices=2")
    reference = _run(config, *two_ranks)
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = _per_step(tmp_path / "runs/tiny/version_0")

    checkpoint = tmp_path / "ckpt/epoch=0-step=5.ckpt"
    assert checkpoint.is_dir() == (strategy != "ddp")  # sharded: a directory with each rank's shard
    resumed = _run(config, *two_ranks, f"--ckpt_path={checkpoint}", "--trainer.logger.init_args.version=1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = _per_step(tmp_path / "runs/tiny/version_1")
    assert min(after) == 5 and set(after) == set(range(5, steps))
    assert {step: expected[step] for step in after} == after
    assert len({row["train/loss"] for row in after.values()}) > 1

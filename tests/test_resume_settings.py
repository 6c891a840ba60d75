"""Resuming with ``--ckpt_path``: settings that cannot change mid-run are refused, naming the setting; settings
that may change (max_steps, the learning rate) take effect instead of the checkpoint's."""

from __future__ import annotations

import csv
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.test_resume import _config, _run

STEPS = 4


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory) -> tuple[Path, Path]:
    """A finished 4-step run of the tiny config (K = 4), with its checkpoint file."""
    directory = tmp_path_factory.mktemp("checkpointed")
    config = _config(directory, checkpoint_every=STEPS, steps=STEPS)
    result = _run(config)
    assert result.returncode == 0, result.stderr[-3000:]
    pristine = directory / "pristine.ckpt"  # resumed runs write ckpt/last.ckpt again: each case starts from this
    shutil.copy(directory / "ckpt/last.ckpt", pristine)
    return config, pristine


def _resume(config: Path, checkpoint: Path, workdir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """A resume in its own process, as a user runs it, from a private copy of the finished run's checkpoint."""
    private = shutil.copy(checkpoint, workdir / "last.ckpt")
    return _run(config, f"--ckpt_path={private}", "--trainer.logger.init_args.version=1", *overrides)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--model.init_args.objective=grpo", r"cannot resume with a changed model.objective \(checkpoint 'gspo', now 'grpo'\)"),
        ("--model.init_args.policy.init_args.hidden_size=64", r"cannot resume with a changed model.policy"),
        ("--model.init_args.temperature=0.7", r"cannot resume with a changed model.temperature \(checkpoint 1.0, now 0.7\)"),
        ("--sampler.group_size=2", r"cannot resume with a changed sampler.group_size \(checkpoint 4, now 2\)"),
        ("--data.init_args.prompts_per_rollout=8", r"settings that decide which prompts come next changed: prompts_per_rollout \(saved 4, now 8\)"),
    ],
)  # fmt: skip
def test_a_setting_that_cannot_change_is_refused(checkpointed, tmp_path, override, message):
    config, checkpoint = checkpointed
    result = _resume(config, checkpoint, tmp_path, override, "--trainer.max_steps=8")
    assert result.returncode == 1, result.stderr[-3000:]
    assert re.search(message, result.stderr.strip().splitlines()[-1]), result.stderr[-3000:]


@pytest.mark.slow
def test_max_steps_and_a_new_learning_rate_take_effect(checkpointed, tmp_path):
    config, checkpoint = checkpointed
    result = _resume(config, checkpoint, tmp_path, "--optimizer.init_args.lr=3e-4", "--trainer.max_steps=6")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = list(csv.DictReader((config.parent / "runs/tiny/version_1/metrics.csv").open()))
    learning_rates = {int(r["step"]): float(r["lr-AdamW"]) for r in rows if r.get("lr-AdamW")}
    assert sorted(learning_rates) == [4, 5]  # resumed at step 4, stopped at the new max_steps
    for step, lr in learning_rates.items():  # the configured lr along the same warm-up (10 steps)
        assert lr == pytest.approx(3e-4 * min(1.0, (step + 1) / 10), rel=1e-6)

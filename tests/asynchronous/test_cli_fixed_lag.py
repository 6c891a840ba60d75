"""Fixed-lag rollouts through the CLI: which weights sampled which round, the lag metrics, an exact resume after a
SIGKILL, and the settings refused when the config is read."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_lightning.rollout.state import evaluation_seed
from tests.test_cli import ROOT, tiny_run_config

STEPS, K, LAG = 24, 4, 2
COMPARED = ("train/loss", "rollout/reward_mean", "train/ratio_mean", "train/clip_frac", "mismatch/kl",
            "rollout/lag_tokens_mean", "rollout/queue_depth", "drift/kl_old_theta_mb0")  # fmt: skip
ASYNC = {"asynchronous": {"mode": "fixed_lag", "lag": LAG}, "rewards": ["tests.fault_helpers.length_reward"],
         "engine": {"class_path": "tests.asynchronous.recording.RecordingHFEngine"}}  # fmt: skip
CORRECTION = {"rollout_correction": {"mode": "tis", "threshold": 2.0}}


def _config(directory: Path, fault: dict | None = None, sampler: dict | None = None) -> Path:
    sections = {"sampler": sampler or ASYNC, "model": {"init_args": {}}}
    if fault:
        sections["trainer"] = {"callbacks": [fault]}
    directory.mkdir(exist_ok=True)
    path = tiny_run_config(directory, STEPS, 5, {key: value for key, value in sections.items() if key != "model"})
    text = path.read_text().replace("    max_new_tokens: 5\n", "    max_new_tokens: 5\n    rollout_correction:\n"
                                    "      mode: tis\n      threshold: 2.0\n")  # fmt: skip
    path.write_text(text)
    return path


def _run(config: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "gspo_lightning", "fit", "-c", str(config), *extra]
    environment = dict(os.environ, PYTHONPATH=str(ROOT), GSPO_TEST_RECORD=str(config.parent / "record.jsonl"),
                       GSPO_TEST_TRAINED=str(config.parent / "trained.jsonl"), MKL_CBWR="COMPATIBLE")  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, cwd=config.parent, env=environment, timeout=900)


def _per_step(run_dir: Path) -> dict[int, dict[str, str]]:
    rows = csv.DictReader((run_dir / "metrics.csv").open())
    return {int(r["step"]): {k: r.get(k, "") for k in COMPARED} for r in rows if r["train/loss"]}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, dict[int, dict[str, str]]]:
    directory = tmp_path_factory.mktemp("fixed_lag")
    result = _run(_config(directory))
    assert result.returncode == 0, result.stderr[-3000:]
    return directory, _per_step(directory / "runs/tiny/version_0")


@pytest.mark.slow
def test_round_r_is_sampled_with_the_weights_of_round_r_minus_lag(uninterrupted):
    directory, _ = uninterrupted
    every = [json.loads(line) for line in (directory / "record.jsonl").read_text().splitlines()]
    calls = [call for call in every if call["group_size"] == 4]  # not the evaluation's (one sample per prompt)
    round_of_seed = {evaluation_seed(0, index, 0): index for index in range(STEPS // K + LAG + 1)}
    sampled = {round_of_seed[call["seed"]]: call["step"] for call in calls if call["seed"] in round_of_seed}
    rounds = STEPS // K
    # every round trained was sampled once, by version max(r - lag, 0) (the weights at that round's first step);
    # the last LAG rounds were sampled ahead and never trained
    assert sorted(sampled) == list(range(rounds + LAG))
    assert {r: sampled[r] // K for r in sampled} == {r: max(r - LAG, 0) for r in sampled}
    assert len([c for c in calls if c["seed"] in round_of_seed]) == rounds + LAG  # none sampled twice


@pytest.mark.slow
def test_lag_and_queue_metrics_follow_the_schedule(uninterrupted):
    _, steps = uninterrupted
    lags = {step // K: float(row["rollout/lag_tokens_mean"]) for step, row in steps.items()}
    assert lags == {r: float(min(r, LAG)) for r in range(STEPS // K)}
    assert {float(row["rollout/queue_depth"]) for row in steps.values()} == {float(LAG)}
    # stale rounds: pi_old (proximal) and the engine's (behaviour) log-probs differ; on-policy round 0 they agree
    assert max(float(steps[s]["mismatch/kl"]) for s in range(K)) < 1e-6
    assert min(float(steps[s]["mismatch/kl"]) for s in range(LAG * K, STEPS, K)) > 1e-6


@pytest.mark.slow
def test_pi_old_is_the_proximal_policy_so_every_rounds_first_step_has_ratio_one(uninterrupted):
    _, steps = uninterrupted
    first = [steps[step] for step in range(0, STEPS, K)]
    assert all(row["train/ratio_mean"] == "1.0" and row["drift/kl_old_theta_mb0"] == "0.0" for row in first), first
    assert any(float(steps[step]["train/ratio_mean"]) != 1.0 for step in range(1, STEPS) if step % K)  # it moves


@pytest.mark.slow
def test_a_fixed_lag_run_killed_mid_round_resumes_bit_for_bit(tmp_path, uninterrupted):
    _, expected = uninterrupted
    killer = {"class_path": "tests.fault_helpers.KillAtStep", "init_args": {"step": 14}}
    interrupted = _run(_config(tmp_path, killer))
    assert interrupted.returncode == -signal.SIGKILL, interrupted.stderr[-3000:]
    checkpoint = tmp_path / "ckpt/last.ckpt"
    assert checkpoint.exists()
    resumed = _run(_config(tmp_path), f"--ckpt_path={checkpoint}", "--trainer.logger.init_args.version=1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = _per_step(tmp_path / "runs/tiny/version_1")
    assert min(after) == 10 and 10 % K != 0  # resumed inside round 2, with rounds 3 and 4 sampled ahead
    assert {step: expected[step] for step in after} == after  # bitwise
    assert len({row["train/loss"] for row in after.values()}) > 1


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--sampler.asynchronous.mode=streamed",
         "sampler.asynchronous.mode must be one of ['off', 'fixed_lag', 'streaming']"),
        ("--sampler.asynchronous.mode=streaming", "needs an engine of its own that generates while the trainer trains"),
        ("--sampler.asynchronous.max_staleness=-1", "sampler.asynchronous.max_staleness must be an integer in [0, 64]"),
        ("--sampler.asynchronous.lag=-1", "sampler.asynchronous.lag must be an integer in [1, 64]"),
        ("--sampler.asynchronous.lag=0", "sampler.asynchronous.lag must be an integer in [1, 64]"),
        ("--sampler.old_logprobs=engine", "needs sampler.old_logprobs: recompute (got 'engine')"),
        ("--sampler.dynamic_sampling=true", "does not support sampler.dynamic_sampling"),
    ],
)
def test_bad_asynchronous_settings_fail_when_the_config_is_read(tmp_path, override, message):
    config = _config(tmp_path, sampler={**ASYNC, "engine": "hf"})
    result = _run(config, override, "--trainer.max_steps=1")
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-2000:]
    assert "warm start" not in result.stderr and "Traceback" not in result.stderr  # refused before anything ran


@pytest.mark.slow
def test_two_ddp_ranks_each_sample_their_own_rounds_ahead(tmp_path):
    config = _config(tmp_path, sampler={**ASYNC, "engine": "hf"})
    result = _run(config, "--trainer.strategy=ddp", "--trainer.devices=2", "--trainer.max_steps=12")
    assert result.returncode == 0, result.stderr[-3000:]
    steps = _per_step(tmp_path / "runs/tiny/version_0")
    assert sorted(steps) == list(range(12))
    assert {step // K: float(row["rollout/lag_tokens_mean"]) for step, row in steps.items()} == {0: 0.0, 1: 1.0, 2: 2.0}


@pytest.mark.slow
def test_clip_fraction_and_correction_are_logged_by_lag(uninterrupted):
    directory, _ = uninterrupted
    rows = [r for r in csv.DictReader((directory / "runs/tiny/version_0/metrics.csv").open()) if r.get("train/loss")]
    for row in rows:
        lag = min(int(row["step"]) // K, LAG)  # every response of a fixed-lag round has the round's lag
        # one lag in the minibatch: its token-weighted clip fraction is the minibatch's
        assert float(row[f"diag/clip_frac_lag_{lag}"]) == pytest.approx(float(row["train/clip_frac"]), abs=1e-6)
        assert row[f"mismatch/log_ratio_mean_lag_{lag}"] != ""
        assert all(row.get(f"diag/clip_frac_lag_{other}", "") == "" for other in range(LAG + 1) if other != lag)

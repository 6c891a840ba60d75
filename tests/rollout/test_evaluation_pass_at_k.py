"""Held-out evaluation with n samples per prompt: unbiased pass@k, seeded and isolated from the training RNG."""

from __future__ import annotations

import csv
import math
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lightning.pytorch.plugins.precision import Precision

from gspo_lightning.cli import main
from gspo_lightning.rollout import PromptBatch
from gspo_lightning.sampling import HeldOutEvaluation

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["1+1=", "12+34=", "7+8=", "5+5="]


class StartsWithEvenDigit:
    """Solved when the completion starts with an even digit (about a quarter of a random tiny model's samples);
    records every call, so a test can recompute pass@k from the completions themselves."""

    def __init__(self) -> None:
        self.calls: list[tuple[list, list[str]]] = []

    def __call__(self, prompts, completions, **columns):
        self.calls.append((list(prompts), list(completions)))
        return [1.0 if completion[:1] in "02468" else 0.0 for completion in completions]


def _setup(policy, tokenizer, step: int = 3, rank: int = 0, prompts: list[str] = PROMPTS):
    batch = PromptBatch(list(prompts), {"answer": [str(i) for i in range(len(prompts))]})
    logged: list[tuple[int, dict[str, float]]] = []
    trainer = SimpleNamespace(
        strategy=None,
        world_size=1,
        global_rank=rank,
        precision_plugin=Precision(),
        datamodule=SimpleNamespace(heldout_dataloader=lambda: [batch]),
        loggers=[SimpleNamespace(log_metrics=lambda metrics, step: logged.append((step, metrics)))],
        global_step=step,
    )
    module = SimpleNamespace(policy=policy, tokenizer=tokenizer, device=torch.device("cpu"))
    return trainer, module, logged


def _expected_pass_at_k(completions: list[str], n: int, k: int) -> float:
    """Mean over prompts of 1 - C(n - c, k) / C(n, k), c counted from the recorded completions."""
    per_prompt = [completions[i : i + n] for i in range(0, len(completions), n)]
    correct = [sum(c[:1] in "02468" for c in samples) for samples in per_prompt]
    return sum(1 - math.comb(n - c, k) / math.comb(n, k) for c in correct) / len(correct)


def test_sampled_evaluation_logs_the_unbiased_pass_at_k_of_its_samples(policy, tokenizer):
    reward = StartsWithEvenDigit()
    trainer, module, logged = _setup(policy, tokenizer)
    evaluation = HeldOutEvaluation(reward, max_new_tokens=4, samples_per_prompt=6, pass_k=[1, 2, 6])
    accuracy = evaluation.evaluate(trainer, module)

    [(prompts, completions)] = reward.calls
    assert len(completions) == len(PROMPTS) * 6
    assert prompts == [p for p in PROMPTS for _ in range(6)]  # each prompt's n samples in a row
    [(step, metrics)] = logged
    assert step == 3 and set(metrics) == {"eval/accuracy", "eval/pass@1", "eval/pass@2", "eval/pass@6"}
    for k in (1, 2, 6):
        assert metrics[f"eval/pass@{k}"] == pytest.approx(_expected_pass_at_k(completions, 6, k), abs=1e-12)
    assert 0 < metrics["eval/pass@1"] < metrics["eval/pass@2"] <= metrics["eval/pass@6"] <= 1  # a mixed outcome
    assert accuracy == metrics["eval/accuracy"] == metrics["eval/pass@1"]
    assert evaluation.history == [(3, accuracy)]
    assert evaluation.description.startswith("held-out pass@1 (6 samples per prompt")


def _completions(policy, tokenizer, step: int = 3, seed: int = 0, rank: int = 0) -> list[str]:
    reward = StartsWithEvenDigit()
    trainer, module, _ = _setup(policy, tokenizer, step=step, rank=rank)
    HeldOutEvaluation(reward, max_new_tokens=4, samples_per_prompt=4, seed=seed).evaluate(trainer, module)
    return reward.calls[0][1]


def test_samples_depend_on_seed_step_and_rank_only_and_leave_the_training_rng_alone(policy, tokenizer):
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    torch_state, python_state, numpy_state = torch.random.get_rng_state(), random.getstate(), np.random.get_state()
    first = _completions(policy, tokenizer)
    assert torch.equal(torch.random.get_rng_state(), torch_state)
    assert random.getstate() == python_state
    assert np.array_equal(np.random.get_state()[1], numpy_state[1])

    torch.rand(1000)  # the training run moves on; a resumed run would sit elsewhere in its stream
    assert _completions(policy, tokenizer) == first
    assert _completions(policy, tokenizer, step=4) != first
    assert _completions(policy, tokenizer, seed=1) != first
    assert _completions(policy, tokenizer, rank=1) != first


def test_one_sample_per_prompt_is_greedy_and_logs_accuracy_only(policy, tokenizer):
    reward = StartsWithEvenDigit()
    trainer, module, logged = _setup(policy, tokenizer)
    evaluation = HeldOutEvaluation(reward, max_new_tokens=4)
    evaluation.evaluate(trainer, module)
    trainer.global_step = 4
    evaluation.evaluate(trainer, module)
    assert evaluation.sampling_settings(module).temperature == 0.0
    assert reward.calls[0][1] == reward.calls[1][1]  # greedy: no randomness, whatever the step's seed
    assert [set(metrics) for _, metrics in logged] == [{"eval/accuracy"}] * 2
    assert logged[0][1]["eval/accuracy"] == _expected_pass_at_k(reward.calls[0][1], 1, 1)
    assert evaluation.description == "held-out greedy accuracy"


def _half(prompts, completions, **columns):
    return [0.5] * len(completions)


@pytest.mark.parametrize(("solved_at", "expected"), [(1.0, 0.0), (0.5, 1.0), (0.25, 1.0)])
def test_a_sample_is_solved_from_solved_at(policy, tokenizer, solved_at, expected):
    trainer, module, logged = _setup(policy, tokenizer)
    evaluation = HeldOutEvaluation(_half, max_new_tokens=2, samples_per_prompt=3, pass_k=[3], solved_at=solved_at)
    assert evaluation.evaluate(trainer, module) == expected
    assert logged[0][1]["eval/pass@3"] == expected


def _first_prompt_only(prompts, completions, **columns):
    return [1.0 if prompt == "1+1=" else 0.0 for prompt in prompts]


@pytest.mark.parametrize(("overflow", "expected"), [("truncate", 0.5), ("skip", 1.0)])
def test_skipped_prompts_leave_all_their_samples_out(policy, tokenizer, overflow, expected):
    trainer, module, logged = _setup(policy, tokenizer, prompts=["1+1=", "12345+67890="])
    context = policy.config.max_position_embeddings
    evaluation = HeldOutEvaluation(
        _first_prompt_only, max_new_tokens=context - 6, prompt_overflow=overflow, samples_per_prompt=2, pass_k=[2]
    )
    assert evaluation.evaluate(trainer, module) == expected
    assert logged[0][1]["eval/pass@2"] == expected


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"samples_per_prompt": 0}, r"evaluation.samples_per_prompt must be >= 1"),
        ({"pass_k": [4]}, r"evaluation.pass_k entries must be between 1 and evaluation.samples_per_prompt=1"),
        ({"samples_per_prompt": 4, "pass_k": [1, 8]}, r"between 1 and evaluation.samples_per_prompt=4, got \[1, 8\]"),
        ({"samples_per_prompt": 4, "pass_k": [0]}, r"evaluation.pass_k entries must be between 1"),
        ({"samples_per_prompt": 4, "pass_k": []}, r"evaluation.pass_k must name at least one k"),
        ({"samples_per_prompt": 4, "pass_k": [2, 2]}, r"evaluation.pass_k entries must be distinct"),
        ({"samples_per_prompt": 4, "temperature": 0.0}, r"evaluation.temperature must be > 0"),
        ({"top_p": 0.0}, r"evaluation.top_p must be in \(0, 1\]"),
        ({"top_k": -1}, r"evaluation.top_k must be >= 0"),
        ({"solved_at": float("nan")}, r"evaluation.solved_at must be a finite number"),
        ({"seed": -1}, r"evaluation.seed must be an integer >= 0"),
    ],
)
def test_bad_settings_are_rejected_naming_the_setting(settings, match):
    with pytest.raises(ValueError, match=match):
        HeldOutEvaluation(_half, **settings)


def test_the_cli_builds_a_sampled_evaluation_and_rejects_a_bad_pass_k(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = str(ROOT / "configs/quickstart.yaml")
    cli = main(["-c", config, "--evaluation.samples_per_prompt=4", "--evaluation.pass_k=[1,4]"], run=False)
    evaluation = next(c for c in cli.trainer.callbacks if isinstance(c, HeldOutEvaluation))
    assert (evaluation.samples_per_prompt, evaluation.pass_k, evaluation.sampling_settings(cli.model).temperature) == (4, (1, 4), 1.0)
    with pytest.raises(ValueError, match=r"evaluation.pass_k entries must be between 1 and .*samples_per_prompt=4"):
        main(["-c", config, "--evaluation.samples_per_prompt=4", "--evaluation.pass_k=[8]"], run=False)


@pytest.mark.slow
def test_sampled_evaluation_leaves_the_training_run_bitwise_unchanged(tmp_path):
    from tests.test_cli import tiny_run_config

    # Evaluations at steps 2 and 6 fall between the sampler's rounds (K = 4): were the global RNG moved, the
    # rollouts of steps 4 and 8 would differ (they do with the isolation removed).
    columns = ("train/loss", "train/entropy", "train/ratio_mean", "rollout/response_len_mean")
    runs, rows = {}, []
    for name, evaluation in (("greedy", {}), ("sampled", {"samples_per_prompt": 4, "every_n_steps": 2})):
        directory = tmp_path / name
        directory.mkdir()
        config = tiny_run_config(directory, max_steps=8, extra={"evaluation": evaluation})
        extra = ["--evaluation.pass_k=[1,4]"] if evaluation else []
        command = [sys.executable, "-m", "gspo_lightning", "fit", "-c", str(config), *extra]
        result = subprocess.run(command, capture_output=True, text=True, cwd=directory)
        assert result.returncode == 0, result.stderr[-3000:]
        rows = list(csv.DictReader((directory / "runs/tiny/version_0/metrics.csv").open()))
        runs[name] = [[row[c] for c in columns] for row in rows if row["train/loss"]]
    assert "held-out pass@1 (4 samples per prompt, temperature 1.0)" in result.stdout
    evaluated = [row for row in rows if row["eval/pass@4"]]
    assert [int(row["step"]) for row in evaluated] == [0, 2, 4, 6, 8]
    assert all(row["eval/accuracy"] == row["eval/pass@1"] for row in evaluated)
    assert len(runs["greedy"]) == 8 and runs["greedy"] == runs["sampled"]

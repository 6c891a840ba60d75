"""The Countdown warm start: demonstrations, what counts as correct, validation, a short training run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gspo_lightning.data import CountdownWarmStartedTinyQwen3
from gspo_lightning.data.countdown_warm_start import COUNTDOWN_ALPHABET
from gspo_lightning.models import TinyQwen3
from gspo_lightning.models.cache import REPORT_FILE
from gspo_lightning.models.supervised import training_batch


def tiny_base(**overrides) -> TinyQwen3:
    settings = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
    return TinyQwen3(**{**settings, "alphabet": COUNTDOWN_ALPHABET, "max_position_embeddings": 32, **overrides})


def test_demonstrations_are_solutions_in_the_prompt_format():
    loader = CountdownWarmStartedTinyQwen3(num_numbers=3, max_number=10, base=tiny_base())
    rows = list(loader.demonstrations(50, seed=1))
    assert all(loader.is_correct(row, row["answer"]) for row in rows)
    tokenizer = loader.load_tokenizer()
    batch = training_batch(tokenizer, rows[:1], loader.prompt_template)
    prompt = f"{rows[0]['numbers']}:{rows[0]['target']}="
    assert tokenizer.decode(batch["input_ids"][0]) == prompt + rows[0]["answer"] + tokenizer.eos_token
    assert (batch["labels"][0] == -100).sum() == len(prompt)  # loss on the expression and eos only


def test_any_valid_expression_counts_not_only_the_demonstrated_one():
    loader = CountdownWarmStartedTinyQwen3(base=tiny_base())
    problem = {"numbers": "3 7 5", "target": "26", "answer": "3*7+5"}
    assert loader.is_correct(problem, "5+7*3") and loader.is_correct(problem, "(7*3)+5")
    assert not loader.is_correct(problem, "3*7+6") and not loader.is_correct(problem, "3*7+5+5")


def test_validation_names_the_setting():
    with pytest.raises(ValueError, match="num_numbers must be >= 2"):
        CountdownWarmStartedTinyQwen3(num_numbers=1, base=tiny_base())
    with pytest.raises(ValueError, match=r"base.alphabet lacks characters the task writes: \['/', ':'\]"):
        CountdownWarmStartedTinyQwen3(base=tiny_base(alphabet="0123456789+-*=() "))
    # 4 numbers up to 100: "100 100 100 100:100000000=" and "((100*100*100*100))" are 26 + 19 characters, then eos
    with pytest.raises(ValueError, match="samples of up to 46 tokens do not fit base.max_position_embeddings=32"):
        CountdownWarmStartedTinyQwen3(num_numbers=4, max_number=100, base=tiny_base())


def test_short_training_run_is_cached_with_its_task_in_the_key(tmp_path: Path):
    settings = dict(base=tiny_base(), max_steps=20, batch_size=16, lr=3e-3, eval_every=10, eval_size=16)
    loader = CountdownWarmStartedTinyQwen3(cache_dir=str(tmp_path), **settings)
    loader.load_model(loader.load_tokenizer())
    report = json.loads((loader.cache_path() / REPORT_FILE).read_text())
    assert report["settings"]["num_numbers"] == 3 and report["settings"]["max_number"] == 10
    assert [entry["step"] for entry in report["history"]] == [10, 20]
    assert report["history"][-1]["loss"] < report["first_loss"]
    other = CountdownWarmStartedTinyQwen3(cache_dir=str(tmp_path), max_number=9, **settings)
    assert other.cache_path() != loader.cache_path()

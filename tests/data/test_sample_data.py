"""The packaged data samples: every reference answer parses, SampleDataset loads them offline."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest

from gspo_lightning.cli import composed_config
from gspo_lightning.data import PromptDataModule, SampleDataset
from gspo_lightning.data import sample_data as samples_module
from gspo_lightning.data.sample_data import available_samples, sample_path
from gspo_lightning.models import Pretrained, TinyQwen3
from gspo_lightning.models.char_tokenizer import SIMPLE_CHAT_TEMPLATE
from gspo_lightning.rewards import MathAnswer

ROOT = Path(__file__).resolve().parents[2]


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in sample_path(name).read_text().splitlines()]


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to open a network connection fails the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_gsm8k_sample_has_the_gsm8k_layout_and_every_answer_checks() -> None:
    sample = rows("gsm8k")
    assert len(sample) >= 30 and all(set(row) == {"question", "answer"} for row in sample)
    finals = []
    for row in sample:
        *reasoning, last = row["answer"].split("\n")
        assert reasoning and re.fullmatch(r"#### -?[0-9][0-9,]*(\.[0-9]+)?", last), row
        finals.append(last.removeprefix("#### ").replace(",", ""))
    # Each reference parses, and its own final number scores 1 against it (and a wrong one 0).
    reward = MathAnswer(gold_format="gsm8k")
    questions, golds = [r["question"] for r in sample], [r["answer"] for r in sample]
    assert reward(questions, [f"\\boxed{{{f}}}" for f in finals], answer=golds) == [1.0] * len(sample)
    assert reward(questions, [f"\\boxed{{{f}1}}" for f in finals], answer=golds) == [0.0] * len(sample)


def test_competition_math_sample_has_the_math_layout_and_every_solution_parses() -> None:
    sample = rows("competition_math")
    assert len(sample) >= 25
    assert all(set(row) == {"problem", "solution", "level", "type"} for row in sample)
    assert all(re.fullmatch(r"Level [1-5]", row["level"]) for row in sample)
    assert all("\\boxed{" in row["solution"] for row in sample)
    reward = MathAnswer(answer_column="solution", gold_format="boxed")
    problems, solutions = [r["problem"] for r in sample], [r["solution"] for r in sample]
    # The solution's own boxed answer matches it: the reference parses and compares.
    boxed = ["\\boxed{" + s.rsplit("\\boxed{", 1)[1] for s in solutions]
    assert reward(problems, boxed, solution=solutions) == [1.0] * len(sample)


def test_sample_dataset_loads_train_and_eval_splits_offline(no_network: None) -> None:
    loaded = SampleDataset("gsm8k", eval_size=6, seed=1).load()
    assert set(loaded) == {"train", "eval"}
    assert len(loaded["eval"]) == 6 and len(loaded["train"]) == len(rows("gsm8k")) - 6
    assert not set(loaded["train"]["question"]) & set(loaded["eval"]["question"])
    again = SampleDataset("gsm8k", eval_size=6, seed=1).load()
    assert loaded["eval"]["question"] == again["eval"]["question"]  # deterministic given the seed
    math = SampleDataset("competition_math", eval_size=4).load()
    assert math["train"].column_names == ["problem", "solution", "level", "type"]


def test_unknown_name_lists_the_samples_found_in_the_folder(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(ValueError, match=r"unknown sample 'gsm9k'; available samples: \[.*'gsm8k'.*\]"):
        SampleDataset("gsm9k")
    with pytest.raises(ValueError, match="unknown sample"):
        SampleDataset("../samples/gsm8k")  # names only, not paths
    (tmp_path / "extra.jsonl").write_text('{"question": "q", "answer": "1"}\n')
    monkeypatch.setattr(samples_module, "SAMPLES_DIR", tmp_path)
    assert available_samples() == ["extra"]


def test_bad_eval_size_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="eval_size must be >= 1"):
        SampleDataset("gsm8k", eval_size=0)
    with pytest.raises(ValueError, match="eval_size .* must be smaller"):
        SampleDataset("gsm8k", eval_size=1000).load()


def test_math_sample_config_tokenizer_covers_every_chat_prompt() -> None:
    # The tiny model's alphabet must cover what its chat template renders, or prompts fill with <unk>.
    config = composed_config(ROOT / "configs/math_sample.yaml")
    policy = TinyQwen3(**config["model"]["init_args"]["policy"]["init_args"])
    tokenizer = policy.load_tokenizer()
    data = config["data"]["init_args"]
    module = PromptDataModule(SampleDataset("gsm8k"), chat_template=True, system_prompt=data["system_prompt"])
    for row in rows("gsm8k"):
        text = tokenizer.apply_chat_template(module.formatter(row), tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.unk_token_id not in ids, text
        assert len(ids) + config["model"]["init_args"]["max_new_tokens"] <= policy.max_position_embeddings


def test_tiny_chat_template_round_trips_and_leaves_default_cache_keys_alone(tiny_pretrained_dir: Path) -> None:
    # Warm-start caches are keyed by settings(): a tokenizer without a template must keep its old key.
    assert "chat_template" not in TinyQwen3().settings()
    assert TinyQwen3(chat_template=SIMPLE_CHAT_TEMPLATE).settings()["chat_template"] == SIMPLE_CHAT_TEMPLATE
    loaded = Pretrained(str(tiny_pretrained_dir)).load_tokenizer()  # the conftest checkpoint, via save_pretrained
    messages = [{"role": "user", "content": "What is 2+3?"}]
    rendered = loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "user: What is 2+3?\nassistant: "

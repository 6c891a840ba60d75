"""Bad settings fail early, through the real CLI, before any model is loaded, naming the setting and the values."""

from __future__ import annotations

import json

import pytest

from gspo_lightning.cli import main
from tests.conftest import TINY
from tests.test_cli import ROOT

QUICKSTART = str(ROOT / "configs/quickstart.yaml")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--sampler.group_size=1", "sampler.group_size must be >= 2"),
        ("--model.init_args.eps_low=0", r"model.eps_low must be in \(0, 1\) for objective 'gspo', got 0"),
        ("--model.init_args.eps_high=1.5", r"model.eps_high must be in \(0, 1\) for objective 'gspo', got 1.5"),
        ("--model.init_args.max_new_tokens=0", "model.max_new_tokens must be >= 1, got 0"),
        ("--model.init_args.objective=ppo", "unknown objective 'ppo'; allowed names: cispo, dapo, dr_grpo, gmpo"),
        ('--model.init_args.objective={"name": "grpo", "options": {"max_tokens": 8}}', r"no option\(s\) \['max_tokens'\]"),
        ("--data.init_args.prompts_per_rollout=0", "data.prompts_per_rollout must be a positive integer"),
    ],
)
def test_bad_setting_fails_while_the_config_is_instantiated(override, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message):
        main(["-c", QUICKSTART, override], run=False)


def test_a_template_column_the_data_set_lacks_fails_at_setup_before_the_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = main(["-c", QUICKSTART, "--data.init_args.prompt_template={problem}="], run=False)
    assert cli.model.policy is None  # the model is built in configure_model, after data setup
    with pytest.raises(ValueError, match=r"problem"):
        cli.datamodule.setup("fit")


_ROWS = [{"question": f"{i}+1", "answer": str(i + 1)} for i in range(8)]


def _jsonl(lines: list[bytes]) -> bytes:
    return b"".join(line + b"\n" for line in lines)


def _rows_with(number: int, line: bytes) -> bytes:
    """The good rows as JSON Lines, with line ``number`` (from 1) replaced by ``line``."""
    lines = [json.dumps(row).encode() for row in _ROWS]
    lines[number - 1] = line
    return _jsonl(lines)


BAD_DATA = [
    ("empty.jsonl", b"", r"data file '.*empty.jsonl' has no rows"),
    ("blank.jsonl", b"\n\n  \n", r"data file '.*blank.jsonl' has no rows"),
    ("latin1.jsonl", _rows_with(3, '{"question": "caf\xe9+1", "answer": "2"}'.encode("latin-1")),
     r"data file '.*latin1.jsonl', line 3: not valid UTF-8 \(byte 0xe9 at column 18"),
    ("truncated.jsonl", _rows_with(2, b'{"question": "2+2", "answer": '),
     r"data file '.*truncated.jsonl', line 2: malformed JSON \(Expecting value at column 31\)"),
    ("list.jsonl", _rows_with(4, b'["4+4", "8"]'), r"line 4: a JSON object \(\{...\}\) expected, got list"),
    ("surrogate.jsonl", _rows_with(2, b'{"question": "x\\udce9", "answer": "1"}'),
     r"line 2: a string holds '\\udce9', an escaped lone surrogate"),
    ("header_only.csv", b"question,answer\n", r"data file '.*header_only.csv' has no rows below its header"),
    ("no_answer.jsonl", _jsonl([json.dumps({"question": row["question"]}).encode() for row in _ROWS]),
     r"sampler.rewards: ExactAnswer reads the column\(s\) \['answer'\], which the 'train' split of "
     r"'.*no_answer.jsonl' does not have; available columns: \['question'\]"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "content", "message"), BAD_DATA, ids=[row[0] for row in BAD_DATA])
def test_bad_data_fails_during_data_setup_before_any_model_is_loaded(name, content, message, tmp_path, monkeypatch):
    from gspo_lightning.models import TinyQwen3

    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_bytes(content)
    loaded = []
    monkeypatch.setattr(TinyQwen3, "load_model", lambda self, tokenizer: loaded.append(1))
    source = {"class_path": "gspo_lightning.data.LoadDataset", "init_args": {"path": str(tmp_path / name), "eval_size": 2}}
    policy = {"class_path": "gspo_lightning.models.TinyQwen3", "init_args": TINY}
    args = ["fit", "-c", QUICKSTART, f"--data.init_args.source={json.dumps(source)}", "--data.init_args.prompts_per_rollout=2",
            f"--model.init_args.policy={json.dumps(policy)}", "--trainer.max_steps=1"]  # fmt: skip
    with pytest.raises(ValueError, match=message):
        main(args)
    assert loaded == []  # failed before configure_model built the policy


CODE_SAMPLE = ROOT / "configs/code_sample.yaml"


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("memory_mb", 16, r"CodeTests.memory_mb must be >= 64 \(a Python interpreter needs it\), got 16"),
        ("disk_mb", 0, "CodeTests.disk_mb must be a positive number, got 0"),
        ("max_files", -1, "CodeTests.max_files must be a positive number, got -1"),
        ("max_workers", 0, r"CodeTests.max_workers must be >= 1 \(or None for the CPU count\), got 0"),
    ],
)
def test_a_bad_sandbox_setting_of_the_code_reward_is_named(setting, value, message, tmp_path, monkeypatch):
    import yaml

    config = yaml.safe_load(CODE_SAMPLE.read_text())
    config["sampler"]["rewards"][0]["init_args"][setting] = value
    path = tmp_path / "code.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message):
        main(["-c", str(path)], run=False)


def test_one_over_long_prompt_among_hundreds_fails_at_fit_start_naming_its_row(tmp_path, monkeypatch):
    from gspo_lightning.engines import HFEngine

    monkeypatch.chdir(tmp_path)
    rows = [{"question": f"{i % 90}+{i % 7}", "answer": str(i % 90 + i % 7)} for i in range(300)]
    rows[217]["question"] = "1+" * 40 + "1"  # 81 characters: with 5 new tokens, more than the context of 64
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    sampled = []
    monkeypatch.setattr(HFEngine, "sample", lambda *args, **kwargs: sampled.append(1))
    source = {"class_path": "gspo_lightning.data.LoadDataset", "init_args": {"path": "data.jsonl", "eval_size": 8}}
    policy = {"class_path": "gspo_lightning.models.TinyQwen3", "init_args": TINY}
    args = ["fit", "-c", QUICKSTART, f"--data.init_args.source={json.dumps(source)}", "--model.init_args.max_new_tokens=5",
            f"--model.init_args.policy={json.dumps(policy)}", "--trainer.max_steps=1"]  # fmt: skip
    with pytest.raises(ValueError, match=r"row \d+ \(counting from 0\) of the 'train' split of 'data.jsonl', the prompt "
                                         r"'1\+1\+1\+1\+1\+1\+1\+1\+1\+1\+1\+1\+1\+1\+1\+1\+1\+1\+1\+1\+...', has 82 tokens: "
                                         r"with model.max_new_tokens=5 it needs 87 > the policy's "
                                         r"context length 64 \(1 prompt\(s\) of the split do\)"):  # fmt: skip
        main(args)
    assert sampled == []  # nothing was sampled: the check ran at fit start

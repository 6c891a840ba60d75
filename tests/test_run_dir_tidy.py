"""A run that fails before writing anything of value leaves no empty ``version_<n>`` behind; a folder that holds a
checkpoint, metrics, or a resumed run's files is never removed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gspo_lightning.cli import command_line
from gspo_lightning.run_dirs import holds_nothing_of_value, remove_if_nothing_of_value
from tests.test_cli_errors import QUICKSTART, TINY_POLICY

# refused at fit start, once the run's folder and config.yaml exist: episodes need a chat template
FAILS_AT_FIT_START = "--sampler.episodes={environment: {class_path: tests.episodes.envs.Counting}}"
REFUSAL = "error: sampler.episodes renders the conversation with the tokenizer's chat template"


def _fit(*arguments: str, monkeypatch, capsys) -> str:
    monkeypatch.delenv("GSPO_LIGHTNING_TRACEBACK", raising=False)
    monkeypatch.setattr(sys, "argv", ["gspo_lightning", "fit", "-c", QUICKSTART, TINY_POLICY, *arguments,
                                      "--trainer.enable_progress_bar=false"])  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        command_line()
    assert exit_.value.code == 1
    return capsys.readouterr().err


def test_a_run_refused_at_fit_start_leaves_no_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert REFUSAL in _fit(FAILS_AT_FIT_START, monkeypatch=monkeypatch, capsys=capsys)
    assert not (tmp_path / "runs").exists()  # runs/ and runs/quickstart/ were this run's too


def test_only_the_failed_runs_own_folder_goes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    earlier = tmp_path / "runs/quickstart/version_0"
    earlier.mkdir(parents=True)
    (earlier / "config.yaml").write_text("an earlier run's\n")
    assert REFUSAL in _fit(FAILS_AT_FIT_START, monkeypatch=monkeypatch, capsys=capsys)
    assert sorted(p.name for p in (tmp_path / "runs/quickstart").iterdir()) == ["version_0"]
    assert (earlier / "config.yaml").read_text() == "an earlier run's\n"


def test_a_resumed_runs_folder_is_kept_when_the_resume_fails(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    resumed = tmp_path / "runs/quickstart/version_0"
    (resumed / "checkpoints").mkdir(parents=True)
    (resumed / "checkpoints/last.ckpt").write_bytes(b"")  # the resumed run's checkpoint, whatever it holds
    monkeypatch.delenv("GSPO_LIGHTNING_TRACEBACK", raising=False)
    monkeypatch.setattr(sys, "argv", ["gspo_lightning", "fit", "-c", QUICKSTART, TINY_POLICY, FAILS_AT_FIT_START,
                                      "--ckpt_path=last", "--trainer.enable_progress_bar=false"])  # fmt: skip
    with pytest.raises((SystemExit, Exception)):
        command_line()
    assert (resumed / "checkpoints/last.ckpt").exists()


@pytest.mark.parametrize(
    ("files", "nothing"),
    [
        ({"config.yaml": "a: 1\n", "hparams.yaml": "{}\n", "metrics.csv": "step,loss\n"}, True),
        ({"config.yaml": "a: 1\n", "completions.jsonl": ""}, True),
        ({"config.yaml": "a: 1\n", "metrics.csv": "step,loss\n0,1.5\n"}, False),  # a logged row
        ({"config.yaml": "a: 1\n", "completions.jsonl": '{"step": 0}\n'}, False),
        ({"config.yaml": "a: 1\n", "checkpoints/last.ckpt": ""}, False),  # a checkpoint, even an empty file
        ({"config.yaml": "a: 1\n", "hf_policy/config.json": "{}"}, False),
    ],
)
def test_what_counts_as_nothing_of_value(files, nothing, tmp_path):
    folder = tmp_path / "version_0"
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    assert holds_nothing_of_value(folder) is nothing
    assert remove_if_nothing_of_value(folder) is nothing
    assert folder.exists() is not nothing


def test_nothing_to_remove_when_the_folder_was_not_created(tmp_path):
    assert remove_if_nothing_of_value(None) is False
    assert remove_if_nothing_of_value(Path(tmp_path / "never_made")) is False

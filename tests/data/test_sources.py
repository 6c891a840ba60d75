"""LoadDataset (local files, saved data sets) and ArithmeticTask."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from gspo_lightning.data import ArithmeticTask, LoadDataset, PromptSource
from gspo_lightning.data.arithmetic import is_heldout

ROWS = [{"question": f"{i}+1", "answer": str(i + 1)} for i in range(40)]


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def assert_splits(loaded: datasets.DatasetDict, train: int, evaluation: int) -> None:
    assert set(loaded) == {"train", "eval"}
    assert (len(loaded["train"]), len(loaded["eval"])) == (train, evaluation)
    assert loaded["train"].column_names == ["question", "answer"]
    # The held-out rows are never training rows.
    assert not set(loaded["train"]["question"]) & set(loaded["eval"]["question"])


def test_jsonl_with_carved_eval_split_is_deterministic(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "data.jsonl", ROWS)
    loaded = LoadDataset(path, eval_size=8, seed=3).load()
    assert_splits(loaded, 32, 8)
    assert loaded["eval"]["question"] == LoadDataset(path, eval_size=8, seed=3).load()["eval"]["question"]
    assert loaded["eval"]["question"] != LoadDataset(path, eval_size=8, seed=4).load()["eval"]["question"]


def test_parquet_file(tmp_path: Path) -> None:
    path = tmp_path / "data.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(path))
    assert_splits(LoadDataset(str(path), eval_size=10).load(), 30, 10)


def test_saved_dataset_directory(tmp_path: Path) -> None:
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    assert_splits(LoadDataset(str(tmp_path / "saved"), eval_size=4).load(), 36, 4)
    with pytest.raises(ValueError, match="single Dataset"):
        LoadDataset(str(tmp_path / "saved"), eval_split="test").load()


def test_saved_dataset_dict_with_and_without_eval_split(tmp_path: Path) -> None:
    saved = datasets.DatasetDict(
        train=datasets.Dataset.from_list(ROWS[:30]), test=datasets.Dataset.from_list(ROWS[30:])
    )
    saved.save_to_disk(str(tmp_path / "saved"))
    path = str(tmp_path / "saved")
    with_eval = LoadDataset(path, eval_split="test", eval_size=4).load()
    assert_splits(with_eval, 30, 4)
    assert with_eval["eval"]["question"] == [row["question"] for row in ROWS[30:34]]  # first eval_size rows
    assert_splits(LoadDataset(path, eval_split="test", eval_size=100).load(), 30, 10)  # shorter: all rows
    assert_splits(LoadDataset(path, split="test", eval_size=2).load(), 8, 2)


def test_missing_split_names_the_available_ones(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "data.jsonl", ROWS)
    with pytest.raises(ValueError, match=r"eval_split='validation'.*available splits: \['train'\]"):
        LoadDataset(path, eval_split="validation").load()
    with pytest.raises(ValueError, match=r"split='dev'.*available splits: \['train'\]"):
        LoadDataset(path, split="dev").load()


def test_bad_settings_fail_early(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="eval_size must be >= 1"):
        LoadDataset("anything", eval_size=0)
    with pytest.raises(ValueError, match="must differ"):
        LoadDataset("anything", split="train", eval_split="train")
    path = write_jsonl(tmp_path / "data.jsonl", ROWS)
    with pytest.raises(ValueError, match="eval_size \\(40\\) must be smaller"):
        LoadDataset(path, eval_size=40).load()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LoadDataset(str(tmp_path / "missing.jsonl")).load()
    (tmp_path / "data.txt").write_text("x")
    with pytest.raises(ValueError, match="unsupported type"):
        LoadDataset(str(tmp_path / "data.txt")).load()


def test_arithmetic_task_sizes_columns_and_heldout_side() -> None:
    task = ArithmeticTask(num_digits=2, operations="+-", train_size=300, eval_size=20, seed=1)
    assert isinstance(task, PromptSource)
    loaded = task.load()
    assert (len(loaded["train"]), len(loaded["eval"])) == (300, 20)
    assert loaded["train"].column_names == loaded["eval"].column_names == ["question", "answer"]
    assert all(is_heldout(question) for question in loaded["eval"]["question"])
    assert not any(is_heldout(question) for question in loaded["train"]["question"])
    assert loaded["train"][0]["answer"] == str(eval(loaded["train"][0]["question"]))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_digits": 0}, "num_digits"),
        ({"operations": "/"}, "operations"),
        ({"train_size": 0}, "train_size"),
        ({"eval_size": 0}, "eval_size"),
    ],
)
def test_arithmetic_task_bad_settings_fail_early(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ArithmeticTask(**kwargs)  # type: ignore[arg-type]

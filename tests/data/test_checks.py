"""Data checks that run while the data module is set up: rows readable as text, rewards' columns present."""

from __future__ import annotations

import datasets
import pyarrow as pa
import pytest

from gspo_lightning.data import LoadDataset, PromptDataModule
from gspo_lightning.data.checks import DataError, check_rows, check_text_file


def _dataset_with_invalid_utf8(row: int) -> datasets.Dataset:
    """Arrow keeps invalid UTF-8 in a string column (a parquet or saved data set from another writer can)."""
    values = [f"{i}+1".encode() for i in range(6)]
    values[row] = b"caf\xe9"
    questions = pa.array(values, pa.binary()).view(pa.string())
    table = pa.table({"question": questions, "answer": [str(i) for i in range(6)]})
    return datasets.Dataset(table)


def test_a_string_arrow_cannot_decode_is_found_with_its_row_and_column():
    with pytest.raises(DataError, match=r"the 'train' split of 'x', row 4 \(counting from 0\), column 'question': not valid UTF-8"):
        check_rows(_dataset_with_invalid_utf8(4), "the 'train' split of 'x'")
    check_rows(datasets.Dataset.from_list([{"question": "café", "answer": "1"}]), "fine")  # real UTF-8 passes


def test_a_saved_data_set_with_invalid_text_fails_at_setup(tmp_path):
    _dataset_with_invalid_utf8(2).save_to_disk(tmp_path / "saved")
    data = PromptDataModule(LoadDataset(str(tmp_path / "saved"), eval_size=1), "{question}=", prompts_per_rollout=1)
    with pytest.raises(DataError, match=r"saved' \(split 'train'\), row 2 \(counting from 0\), column 'question'"):
        data.setup("fit")



def test_a_good_text_file_passes(tmp_path):
    path = tmp_path / "good.jsonl"
    path.write_text('{"question": "café", "answer": "1"}\n\n{"question": "2", "answer": "2"}\n', encoding="utf-8")
    check_text_file(path)

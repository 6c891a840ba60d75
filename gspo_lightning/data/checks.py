"""Data that fails early and clearly: while the data module is set up, before any model is loaded.

A bad row otherwise surfaces as a bare ``StopIteration`` (an empty file), an "Invalid encoding" deep in the
JSON reader, or a ``UnicodeDecodeError`` when the row is finally drawn, possibly hours into a run. Each error
here names the file (or source), the row and the problem.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import datasets
import pyarrow as pa

from gspo_lightning.validation import DataError


class MissingDataFile(DataError, FileNotFoundError):
    """A local data file that does not exist."""


def check_text_file(path: str | Path) -> None:
    """A local JSON Lines, JSON or CSV file: UTF-8 on every line, at least one row, and for JSON Lines one
    well-formed JSON object per line (strings included: no lone surrogates, which no tokenizer can encode).

    Line numbers start at 1, as an editor shows them.
    """
    path = Path(path)
    json_lines = path.suffix.lower() == ".jsonl"
    rows = 0
    with path.open("rb") as file:
        for number, raw in enumerate(file, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DataError(
                    f"data file {str(path)!r}, line {number}: not valid UTF-8 (byte 0x{raw[error.start]:02x} at "
                    f"column {error.start + 1}: {error.reason}); re-encode the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            rows += 1
            if json_lines:
                _check_json_object(line.rstrip("\r\n"), path, number)
    header = 1 if path.suffix.lower() == ".csv" else 0
    if rows <= header:
        raise DataError(f"data file {str(path)!r} has no rows" + (" below its header" if header else ""))


def _check_json_object(line: str, path: Path, number: int) -> None:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as error:
        raise DataError(
            f"data file {str(path)!r}, line {number}: malformed JSON ({error.msg} at column {error.colno}); "
            "each line of a .jsonl file must be one JSON object"
        ) from None
    if not isinstance(value, dict):
        raise DataError(
            f"data file {str(path)!r}, line {number}: a JSON object ({{...}}) expected, got {type(value).__name__}"
        )
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as error:
        raise DataError(
            f"data file {str(path)!r}, line {number}: a string holds {error.object[error.start:error.end]!r}, "
            "an escaped lone surrogate that is not text (no tokenizer can encode it)"
        ) from None


def check_rows(dataset: datasets.Dataset, where: str) -> None:
    """Every split has rows, and every string in it is valid UTF-8 (Arrow keeps invalid bytes that Python only
    fails to decode when the row is read). ``where`` names the data in the message, e.g. the file and split."""
    if len(dataset) == 0:
        raise DataError(f"{where} has no rows")
    table = dataset.data.table
    try:
        table.validate(full=True)  # checks the UTF-8 of every string, in C++, in well under a second per GB
    except pa.ArrowInvalid:
        row, column = _first_invalid_string(table)
        raise DataError(f"{where}, row {row} (counting from 0), column {column!r}: not valid UTF-8") from None


def _first_invalid_string(table: pa.Table) -> tuple[int, str]:
    """(row, column) of the first string Arrow finds invalid; only run once validation has failed."""
    for name in table.column_names:
        offset = 0
        for chunk in table.column(name).chunks:
            as_bytes = {pa.string(): pa.binary(), pa.large_string(): pa.large_binary()}.get(chunk.type)
            index = None if as_bytes is None else _first_undecodable(chunk.view(as_bytes).to_pylist())
            if index is not None:
                return offset + index, name
            offset += len(chunk)
    return -1, "?"


def _first_undecodable(values: Iterable[bytes | None]) -> int | None:
    for index, value in enumerate(values):
        if value is not None:
            try:
                value.decode("utf-8")
            except UnicodeDecodeError:
                return index
    return None

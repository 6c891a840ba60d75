"""``RunCSVLogger``: Lightning's CSV logger, made safe to kill and to resume.

Lightning's ``CSVLogger`` keeps rows in memory until every 100th step (a SIGKILL loses them all, the whole run
for a short one) and deletes an existing ``metrics.csv`` when a run logs into the same folder again (so a resumed
run's history is split across ``version_<n>`` folders, or lost). This logger writes the same files in the same
layout (``<save_dir>/<name>/version_<n>/metrics.csv``: a ``step`` column and one per metric, a row per logging
call; ``hparams.yaml``), but appends every row as it is logged, and a run that logs into a folder holding an
earlier ``metrics.csv`` continues it: the rows from the first step it logs onwards are replaced (a run resumed
from the checkpoint of step s logs step s again), the earlier ones kept.
"""

from __future__ import annotations

import csv
import os
import tempfile
from typing import Any

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.core.saving import save_hparams_to_yaml
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only


class RunCSVLogger(CSVLogger):
    """CSV metrics written as they are logged, continued (not deleted) by a resumed run in the same folder.

    Args:
        save_dir: folder of all runs; each run writes into ``<save_dir>/<name>/version_<n>``.
        name: the run's name (a task config sets it).
        version: the run's version; None: the next free one. ``--ckpt_path`` sets it to the resumed run's.
        prefix: put before every metric name.
        flush_logs_every_n_steps: write to disk every this many steps (1: every row as logged).
    """

    def __init__(
        self,
        save_dir: str = "runs",
        name: str = "lightning_logs",
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 1,
    ) -> None:
        super().__init__(save_dir, name, version, prefix, flush_logs_every_n_steps)
        self._writer: MetricsWriter | None = None

    @property
    @rank_zero_experiment
    def experiment(self) -> MetricsWriter:
        """The writer of this run's ``metrics.csv`` and ``hparams.yaml``."""
        if self._writer is None:
            self._writer = MetricsWriter(self.log_dir)
        return self._writer

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._writer is not None:
            self._writer.save()


class MetricsWriter:
    """One run folder's ``metrics.csv`` (in ``CSVLogger``'s format) and ``hparams.yaml``."""

    NAME_METRICS_FILE = "metrics.csv"
    NAME_HPARAMS_FILE = "hparams.yaml"

    def __init__(self, log_dir: str) -> None:
        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir
        self.metrics_file_path = os.path.join(log_dir, self.NAME_METRICS_FILE)
        self.hparams: dict[str, Any] = {}
        self._earlier, self._keys = _read_rows(self.metrics_file_path)  # what an earlier run wrote here
        self._pending: list[dict[str, Any]] = []
        self._rewrite = False
        self._continued = False  # the first row logged has decided what of an earlier file stays
        self._saved = False  # the file holds this writer's rows

    def log_hparams(self, params: dict[str, Any]) -> None:
        self.hparams.update(params)
        save_hparams_to_yaml(os.path.join(self.log_dir, self.NAME_HPARAMS_FILE), self.hparams)

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        if step is None:
            step = len(self._pending)
        if not self._continued:  # the first row decides what of an earlier file is kept: the steps before it
            self._continued = True
            kept = [row for row in self._earlier if _step(row) is not None and _step(row) < step]
            self._rewrite = len(kept) != len(self._earlier)
            self._earlier = kept
        row = {name: _scalar(value) for name, value in metrics.items()} | {"step": step}
        if not set(row) <= set(self._keys):  # a new column: the file is written again with the wider header
            self._keys = sorted(set(self._keys) | set(row))
            self._rewrite = True
        self._pending.append(row)

    def save(self) -> None:
        """Append the rows logged since the last save; write the file again when its columns grew or an earlier
        run's later rows are replaced."""
        if not self._pending and not self._rewrite:
            return
        if self._rewrite:  # the file so far: an earlier run's kept rows before the first save, else its own rows
            written = self._earlier if not self._saved else _read_rows(self.metrics_file_path)[0]
            _write_atomically(self.metrics_file_path, self._keys, written + self._pending)
            self._rewrite = False
        else:
            with open(self.metrics_file_path, "a", newline="") as handle:
                csv.DictWriter(handle, fieldnames=self._keys).writerows(self._pending)
        self._saved, self._earlier, self._pending = True, [], []


def _read_rows(path: str) -> tuple[list[dict[str, Any]], list[str]]:
    if not os.path.isfile(path):
        return [], []
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        rows = [row for row in reader if _step(row) is not None]  # a row cut short by a kill has no valid step
        return rows, list(reader.fieldnames or [])


def _write_atomically(path: str, keys: list[str], rows: list[dict[str, Any]]) -> None:
    folder = os.path.dirname(path)
    handle, temporary = tempfile.mkstemp(prefix=".metrics-", suffix=".csv", dir=folder)
    try:
        with os.fdopen(handle, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=keys, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def _step(row: dict[str, Any]) -> int | None:
    try:
        return int(float(row.get("step") or ""))
    except ValueError:
        return None


def _scalar(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value

"""``python -m gspo_lightning plot <run dir> [<run dir> ...]``: a run's health in one PNG, several runs overlaid.

Reads the ``metrics.csv`` the CSV logger writes (a run directory, its parent holding ``version_*`` directories, of
which the newest is read, or the file itself) and draws reward, held-out accuracy, clip fraction, sequence-ratio
quantiles, entropy and the per-minibatch drift KL(pi_old || pi_theta). Needs matplotlib
(``pip install "gspo_lightning[plot]"``).
"""

from __future__ import annotations

import argparse
import csv
import math
import re
from collections import defaultdict
from pathlib import Path

PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward (rollout/reward_mean)", ("rollout/reward_mean",)),
    ("held-out accuracy (eval/accuracy)", ("eval/accuracy",)),
    ("clip fraction (train/clip_frac)", ("train/clip_frac",)),
    ("sequence ratio p05 / p50 / p95 (diag/seq_ratio_*)", ("diag/seq_ratio_p05", "diag/seq_ratio_p50", "diag/seq_ratio_p95")),
    ("entropy (train/entropy)", ("train/entropy",)),
    ("drift per minibatch: KL(pi_old || pi_theta)", ("drift/kl_old_theta_mb*",)),
)  # fmt: skip
"""(title, metric names) of each panel; a trailing ``*`` takes every metric with that prefix."""

Series = dict[str, tuple[list[int], list[float]]]


def metrics_file(path: Path) -> Path:
    """The ``metrics.csv`` that ``path`` names: the file, a run directory's, or the newest ``version_*``'s."""
    if path.is_file():
        return path
    if (path / "metrics.csv").is_file():
        return path / "metrics.csv"
    versions = sorted(path.glob("version_*/metrics.csv"), key=lambda p: _version_number(p.parent.name))
    if not versions:
        raise FileNotFoundError(f"{path}: no metrics.csv here or in a version_* directory (a CSVLogger run dir?)")
    return versions[-1]


def read_metrics(path: Path) -> Series:
    """Every logged metric of a CSV-logger file: name -> (steps, values), empty and non-numeric cells skipped."""
    by_name: dict[str, dict[int, float]] = defaultdict(dict)
    with metrics_file(path).open(newline="") as handle:
        for row in csv.DictReader(handle):
            step = row.get("step")
            if step in (None, ""):
                continue
            for name, cell in row.items():
                value = _number(cell)
                if name not in ("step", "epoch") and value is not None and math.isfinite(value):
                    by_name[name][int(float(step))] = value
    return {name: (sorted(values), [values[s] for s in sorted(values)]) for name, values in by_name.items()}


def panel_series(series: Series, names: tuple[str, ...]) -> Series:
    """The metrics of one panel, in order (a ``prefix*`` name expands to every metric it matches)."""
    chosen: Series = {}
    for name in names:
        if name.endswith("*"):
            matches = sorted((n for n in series if n.startswith(name[:-1])), key=_trailing_number)
            chosen |= {n: series[n] for n in matches}
        elif name in series:
            chosen[name] = series[name]
    return chosen


def smooth(steps: list[int], values: list[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` steps (not points): a value logged every 100 steps, such as the
    held-out accuracy, stays as it is with a window of 10 (1: unchanged)."""
    if window <= 1:
        return list(values)
    out, first = [], 0
    for i, step in enumerate(steps):
        while steps[first] <= step - window:
            first += 1
        out.append(sum(values[first : i + 1]) / (i + 1 - first))
    return out


def plot_runs(runs: dict[str, Series], output: Path, window: int = 10) -> Path:
    """Draw ``runs`` (label -> metrics) into ``output``, one colour per run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise SystemExit('plot needs matplotlib: pip install "gspo_lightning[plot]"') from error
    figure, axes = plt.subplots(2, 3, figsize=(16, 8.5), constrained_layout=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, (title, names) in zip(axes.flat, PANELS, strict=True):
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("optimizer step")
        drawn = False
        for index, (label, series) in enumerate(runs.items()):
            chosen = panel_series(series, names)
            drawn |= bool(chosen)
            _draw_panel(axis, chosen, label, colours[index % len(colours)], window if len(names) == 1 else 1)
        if not drawn:
            axis.text(0.5, 0.5, "not logged", ha="center", va="center", transform=axis.transAxes, color="grey")
        elif len(runs) > 1 or len(names) > 1 or names[0].endswith("*"):
            axis.legend(fontsize=7)
    figure.suptitle(f"smoothed over {window} steps where a panel has one series" if window > 1 else "")
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=110)
    plt.close(figure)
    return output


def _draw_panel(axis, chosen: Series, label: str, colour: str, window: int) -> None:
    styles = ("-", "--", ":", "-.")
    for number, (name, (steps, values)) in enumerate(chosen.items()):
        suffix = "" if len(chosen) == 1 else f" {name.rsplit('/', 1)[-1]}"
        marker = "o" if len(steps) < 30 else None  # held-out accuracy: a few points
        axis.plot(steps, smooth(steps, values, window), styles[number % len(styles)], color=colour, marker=marker,
                  markersize=3, linewidth=1.2, alpha=1.0 if number == 0 else 0.75, label=label + suffix)  # fmt: skip


def run_label(path: Path) -> str:
    """A short name for a run: its directory, with the run's name in front of a ``version_N``."""
    directory = path.parent if path.is_file() else path
    if re.fullmatch(r"version_\d+", directory.name):
        return f"{directory.parent.name}/{directory.name}"
    return directory.name


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m gspo_lightning plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (or metrics.csv files) to overlay")
    parser.add_argument("-o", "--output", type=Path, default=None, help="the PNG (default: <first run>/run.png)")
    parser.add_argument("--smooth", type=int, default=10, help="moving-average window in steps (1: raw)")
    args = parser.parse_args(argv)
    if args.smooth < 1:
        parser.error(f"--smooth must be >= 1, got {args.smooth}")
    try:
        runs = {run_label(path): read_metrics(path) for path in args.runs}
    except FileNotFoundError as error:
        parser.error(str(error))
    output = args.output or metrics_file(args.runs[0]).parent / "run.png"
    print(plot_runs(runs, output, args.smooth))
    return output


def _number(cell: str | None) -> float | None:
    try:
        return float(cell) if cell not in (None, "") else None
    except ValueError:
        return None


def _version_number(name: str) -> int:
    digits = name.removeprefix("version_")
    return int(digits) if digits.isdigit() else -1


def _trailing_number(name: str) -> int:
    match = re.search(r"(\d+)$", name)
    return int(match.group(1)) if match else -1

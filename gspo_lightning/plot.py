"""``python -m gspo_lightning plot <run dir> [<run dir> ...]``: a run's health in one PNG, several runs overlaid.

Reads the ``metrics.csv`` the CSV logger writes (a run directory, its parent holding ``version_*`` directories, of
which the newest is read, or the file itself) and draws one panel per quantity the run logged (see ``PANELS``):
reward, held-out accuracy and pass@k, loss, clip fraction, sequence-ratio quantiles, per-minibatch drift
KL(pi_old || pi_theta), entropy, response length, zero-variance groups, learning rate and MoE expert changes.
Noisy series are drawn per step (thin, light) under a trailing mean (bold); held-out evaluations as markers, never
smoothed. One colour per series for one run, one per run (and a line style per series) for several. Needs
matplotlib (``pip install "gspo_lightning[plot]"``).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Panel:
    """One panel: what it shows (``title``), its y axis with its unit, and the metrics it draws."""

    title: str
    ylabel: str
    names: tuple[str, ...]  # a trailing ``*`` takes every metric with that prefix
    kind: str = "noisy"  # "noisy": per step under a trailing mean; "sparse": markers, never smoothed; "exact": as is
    log: bool = False  # a log y axis (symlog when a series is 0) where the values span decades
    percent: bool = False  # values are fractions, labelled in %


PANELS: tuple[Panel, ...] = (
    Panel("reward", "mean reward of the rollout batch", ("rollout/reward_mean",)),
    Panel("held-out accuracy", "held-out prompts solved", ("eval/accuracy", "eval/pass@*"), "sparse", percent=True),
    Panel("loss", "loss  -J (+ KL penalty)", ("train/loss",)),
    Panel("clip fraction", "response tokens clipped", ("train/clip_frac",), percent=True),
    Panel("sequence ratio quantiles", "s_i = (pi_theta / pi_old)^(1/|y|)",
          ("diag/seq_ratio_p05", "diag/seq_ratio_p50", "diag/seq_ratio_p95")),
    Panel("drift per minibatch", "KL(pi_old || pi_theta), nats/token", ("drift/kl_old_theta_mb*",), log=True),
    Panel("entropy", "policy entropy, nats/token", ("train/entropy",)),
    Panel("response length", "tokens per response", ("rollout/response_len_mean", "rollout/response_len_max")),
    Panel("groups without signal", "groups with all rewards equal", ("rollout/zero_variance_frac",), percent=True),
    Panel("learning rate", "learning rate", ("lr-*",), "exact", log=True),
    Panel("MoE expert changes per minibatch", "(token, expert) pairs changed", ("moe/expert_change_mb*",),
          percent=True),
)  # fmt: skip
"""The panels in reading order; a run draws those of which it logged at least one metric."""

Series = dict[str, tuple[list[int], list[float]]]
LINE_STYLES, MARKERS = ("-", "--", ":", "-."), ("o", "s", "^", "D", "v", "P")
RAW, SMOOTHED = {"linewidth": 0.5, "alpha": 0.25}, {"linewidth": 1.6}  # the per-step trace under its trailing mean


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


def present_panels(runs: dict[str, Series]) -> list[tuple[Panel, list[str]]]:
    """The panels of which some run logged a metric, each with the metric names drawn (over all runs, in order)."""
    present = []
    for panel in PANELS:
        names = {name: None for series in runs.values() for name in panel_series(series, panel.names)}
        if names:
            present.append((panel, list(names)))
    return present


def default_window(runs: dict[str, Series]) -> int:
    """A 50th of the longest run's steps, at least 10: as smooth at 2000 steps as at 500."""
    last = max((steps[-1] for series in runs.values() for steps, _ in series.values() if steps), default=0)
    return max(10, round(last / 50))


def build_figure(runs: dict[str, Series], window: int | None = None):
    """The figure of ``runs`` (label -> metrics): one panel per quantity logged, sized to their number; noisy
    series under a trailing mean over ``window`` steps (None: ``default_window``; 1: per step only)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise SystemExit('plot needs matplotlib: pip install "gspo_lightning[plot]"') from error
    panels = present_panels(runs)
    if not panels:
        raise ValueError(f"none of the plotted metrics was logged (runs: {', '.join(runs)})")
    window = window or default_window(runs)
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(4.3 * columns, 3.0 * rows + 0.5), layout="constrained")
    grid = figure.subplots(rows, columns, squeeze=False)
    for axis, (panel, names) in zip(grid.flat, panels):
        _draw_panel(axis, panel, names, runs, window)
    for axis in grid.flat[len(panels) :]:
        axis.remove()
    _decorate(figure, runs, window, any(panel.kind == "sparse" for panel, _ in panels))
    return figure


def _draw_panel(axis, panel: Panel, names: list[str], runs: dict[str, Series], window: int) -> None:
    values, labels = [], _short_names(names)
    for run_index, series in enumerate(runs.values()):
        for name, (steps, ys) in panel_series(series, panel.names).items():
            number = names.index(name)
            style = _style(run_index, len(runs), number)
            if panel.kind == "sparse":
                _draw_sparse(axis, steps, ys, style, labels[number], panel.percent, _sides(runs, name, ys))
            else:
                _draw_noisy(axis, steps, ys, style, labels[number], window if panel.kind == "noisy" else 1)
            values += ys
    axis.set_title(f"{panel.title}\n{_metric_names(names)}", fontsize=10)
    axis.set_xlabel("optimizer step", fontsize=9)
    axis.set_ylabel(panel.ylabel, fontsize=9)
    axis.tick_params(labelsize=8)
    axis.grid(alpha=0.25, linewidth=0.5)
    _format_y(axis, panel, values)
    if len(names) > 1:
        _series_legend(axis, panel, names, len(runs))


def _style(run_index: int, run_count: int, series_index: int) -> dict:
    """One run: a colour per series. Several: the run's colour, and a line style and marker per series."""
    colours = _colours()
    if run_count == 1:
        return {"color": colours[series_index % len(colours)], "linestyle": "-", "marker": MARKERS[0]}
    return {"color": colours[run_index % len(colours)], "linestyle": LINE_STYLES[series_index % len(LINE_STYLES)],
            "marker": MARKERS[series_index % len(MARKERS)]}  # fmt: skip


def _draw_noisy(axis, steps: list[int], values: list[float], style: dict, label: str, window: int) -> None:
    """The per-step values thin and light under their trailing mean, bold, in one colour (window 1: raw only)."""
    colour, linestyle = style["color"], style["linestyle"]
    if window > 1:
        axis.plot(steps, values, "-", color=colour, label=f"_{label} per step", **RAW)
        axis.plot(steps, smooth(steps, values, window), linestyle, color=colour, label=label, **SMOOTHED)
    else:
        axis.plot(steps, values, linestyle, color=colour, label=label, linewidth=0.8)


def _draw_sparse(axis, steps: list[int], values: list[float], style: dict, label: str, percent: bool,
                 above: tuple[bool, bool]) -> None:  # fmt: skip
    """Held-out evaluations: each a marker, as logged, joined by a thin line; the first and last value written
    (above or below their marker, as ``above`` says for each)."""
    colour = style["color"]
    axis.plot(steps, values, style["linestyle"], color=colour, marker=style["marker"], markersize=5, linewidth=0.8,
              alpha=0.9, label=label)  # fmt: skip
    for index, up in sorted({0: above[0], len(steps) - 1: above[1]}.items()):
        text = f"{values[index]:.1%}" if percent else f"{values[index]:.3g}"
        align = "left" if index == 0 and len(steps) > 1 else "right" if index > 0 else "center"
        axis.annotate(text, (steps[index], values[index]), xytext=(0, 7 if up else -9), textcoords="offset points",
                      ha=align, va="bottom" if up else "top", fontsize=8, color=colour)  # fmt: skip
    axis.margins(y=0.18)


def _sides(runs: dict[str, Series], name: str, values: list[float]) -> tuple[bool, bool]:
    """Whether a run's first and last value of ``name`` go above their markers: where no run's is higher (so two
    runs' values sit on either side of their curves)."""
    ends = [series[name][1] for series in runs.values() if name in series]
    return values[0] >= max(other[0] for other in ends), values[-1] >= max(other[-1] for other in ends)


def _format_y(axis, panel: Panel, values: list[float]) -> None:
    """A log y (symlog where some value is 0) when the positive values span decades; % or scientific ticks else."""
    from matplotlib.ticker import PercentFormatter

    positive = sorted(v for v in values if v > 0)
    if panel.log and positive and positive[-1] > 20 * positive[0]:
        if len(positive) == len(values):
            axis.set_yscale("log")
        else:  # exact zeros (drift at minibatch 0): a linear stretch up to the smallest values, log above
            low = math.floor(math.log10(positive[len(positive) // 20]))
            axis.set_yscale("symlog", linthresh=10.0**low, linscale=0.5)
            # 0, then every decade above the linear stretch: a tick at its edge would overprint the 0
            axis.set_yticks([0.0] + [10.0**d for d in range(low + 1, math.ceil(math.log10(positive[-1])) + 1)])
    elif panel.percent:
        axis.yaxis.set_major_formatter(PercentFormatter(xmax=1.0, decimals=None))
    else:
        axis.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4), useOffset=False)


def _series_legend(axis, panel: Panel, names: list[str], run_count: int) -> None:
    """The panel's series by name: their colours for one run; grey line styles (markers) for several."""
    if run_count == 1:
        axis.legend(fontsize=7, loc="best", framealpha=0.7)
        return
    from matplotlib.lines import Line2D

    sparse = panel.kind == "sparse"
    handles = [Line2D([], [], color="0.3", linestyle=LINE_STYLES[i % len(LINE_STYLES)],
                      marker=MARKERS[i % len(MARKERS)] if sparse else None) for i in range(len(names))]  # fmt: skip
    axis.legend(handles, _short_names(names), fontsize=7, loc="best", framealpha=0.7)


def _decorate(figure, runs: dict[str, Series], window: int, evaluated: bool) -> None:
    """The title (which run, how it is smoothed) and, for several runs, one legend of their colours."""
    how = f"thin: per step, bold: trailing mean over {window} steps" if window > 1 else "per step, raw"
    how += "; markers: held-out evaluations" if evaluated else ""
    if len(runs) == 1:
        figure.suptitle(f"{next(iter(runs))}  ({how})", fontsize=11)
        return
    from matplotlib.lines import Line2D

    colours = _colours()
    handles = [Line2D([], [], color=colours[i % len(colours)], linewidth=2) for i in range(len(runs))]
    figure.legend(handles, list(runs), loc="outside upper center", ncols=min(len(runs), 4), fontsize=10,
                  title=how, title_fontsize=9, frameon=False)  # fmt: skip


def plot_runs(runs: dict[str, Series], output: Path, window: int | None = None) -> Path:
    """Draw ``runs`` (label -> metrics) into the PNG ``output``."""
    figure = build_figure(runs, window)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=150)
    return output


def _metric_names(names: list[str]) -> str:
    """The metrics of a panel in a title: ``diag/seq_ratio_{p05, p50, p95}``."""
    if len(names) == 1:
        return names[0]
    stem = _common_stem(names)
    return f"{stem}{{{', '.join(_short_names(names))}}}"


def _short_names(names: list[str]) -> list[str]:
    """Names less their shared stem: mb0, mb1 for drift/kl_old_theta_mb0, drift/kl_old_theta_mb1."""
    if len(names) == 1:
        return [names[0].rsplit("/", 1)[-1]]
    stem = _common_stem(names)
    return [name[len(stem) :] for name in names]


def _common_stem(names: list[str]) -> str:
    prefix = os.path.commonprefix(names)
    return prefix[: max(prefix.rfind("_"), prefix.rfind("/")) + 1]


def _colours() -> list[str]:
    import matplotlib

    return matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]


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
    parser.add_argument("--smooth", type=int, default=None,
                        help="moving-average window in steps (default: a 50th of the run, at least 10; 1: raw)")
    args = parser.parse_args(argv)
    if args.smooth is not None and args.smooth < 1:
        parser.error(f"--smooth must be >= 1, got {args.smooth}")
    try:
        runs = {run_label(path): read_metrics(path) for path in args.runs}
        output = args.output or metrics_file(args.runs[0]).parent / "run.png"
        print(plot_runs(runs, output, args.smooth))
    except (FileNotFoundError, ValueError) as error:
        parser.error(str(error))
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

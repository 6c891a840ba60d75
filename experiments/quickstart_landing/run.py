"""Whether the quick start learns wherever its warm start lands: the full run from forced starting points (issue 38).

    python experiments/quickstart_landing/run.py          # about 35 minutes on 2 CPU cores

Where the supervised warm start stops depends on floating-point rounding (it stops at the first check, every 20
steps, where its train-side greedy accuracy reaches ``target_accuracy: 0.3``), so each machine starts RL from
another held-out accuracy. This experiment forces the landing: for each of ``--landings`` (held-out greedy accuracy
at RL step 0) it searches the step at which the warm start stops (``eval_every=N`` with ``target_accuracy=0``: the
first check, at step N, stops it; everything else, the learning-rate warm-up included, is the quick start's, so
every stop lies on the quick start's own trajectory) with one-step probes (``--trainer.max_steps=1``) until step 0
lies within ``TOLERANCE`` of the landing; then it runs the full quick start (``configs/quickstart.yaml``, 2000
steps, everything else as configured) from that warm start. It also runs the quick start exactly as configured,
and as configured on the slowest machine at hand: one torch thread pinned to one core (``OMP_NUM_THREADS=1``,
core 0), whose numerics, hence landing, differ again.

Each landing has its own warm-start cache (``GSPO_LIGHTNING_CACHE``) under ``--scratch``, so the user's cache is
untouched and an interrupted experiment resumes: finished probes and runs are kept in ``progress.jsonl`` beside
this file and skipped by a rerun (the file is removed once every run is done).

Writes beside this file ``results.csv`` (one row per run: the warm start, held-out accuracy at step 0 and at the
end, the gain, the time), ``probes.csv`` (each probe's stop and landing), ``curves.csv`` (held-out accuracy,
reward and clip fraction by step), ``landing.png`` (when matplotlib is installed) and ``output.txt`` (the table).
Exits 1 if a run that starts between 25% and 45% gains fewer than 30 points by its end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

HERE = Path(__file__).parent
PROGRESS = HERE / "progress.jsonl"
CURVE_COLUMNS = common.load_script(HERE.parent / "quickstart/run.py").CURVE_COLUMNS
LANDINGS = (0.25, 0.30, 0.35, 0.40, 0.45)
JUDGED = (0.25, 0.45)
"""Runs starting in this range of held-out accuracy (inclusive) must gain ``MIN_GAIN`` (issue 38)."""
MIN_GAIN = 0.30
TOLERANCE = 0.025
"""A probe hits a landing when its step-0 accuracy is within this of it."""
FIRST_STOP = 440
"""The first probe's stop: where seed 0's warm start stops as configured on the machine of ``output.txt``."""
STEPS_PER_POINT = 1.0
"""How far a probe on one side of its landing moves the stop: about the slope of held-out accuracy near 30%."""
MAX_MOVE = 40
MAX_PROBES = 8
POLICY = "--model.init_args.policy.init_args"


class Probe(NamedTuple):
    """One forced warm start: the step it stopped at and the held-out accuracy RL starts from."""

    seed: int
    stop: int
    step0: float


class Plan(NamedTuple):
    """One full run: forced to ``landing`` (None: the warm start as configured), on one core or not."""

    name: str
    seed: int
    landing: float | None = None
    one_core: bool = False


def closest(probes: Sequence[Probe], landing: float) -> Probe | None:
    """The probe whose step-0 accuracy is nearest ``landing`` (the earlier stop on a tie); None without probes."""
    return min(probes, key=lambda p: (abs(p.step0 - landing), p.stop), default=None)


def next_stop(probes: Sequence[Probe], landing: float, tolerance: float = TOLERANCE) -> int | None:
    """The warm-start step to probe next for ``landing``, or None: a probe already lies within ``tolerance``, or
    the bracket holds no step between its two ends.

    Without probes: ``FIRST_STOP``. With probes on both sides: the midpoint of the bracketing stops (a later stop
    lands higher). On one side only: that side's nearest stop moved towards the landing by ``STEPS_PER_POINT``
    steps per point of accuracy still to go (at least 1, at most ``MAX_MOVE``; never before step 1).
    """
    best = closest(probes, landing)
    if best is None:
        return FIRST_STOP
    if abs(best.step0 - landing) <= tolerance:
        return None
    below = [p for p in probes if p.step0 < landing]
    above = [p for p in probes if p.step0 > landing]
    if below and above:
        low, high = max(p.stop for p in below), min(p.stop for p in above)
        return None if high - low <= 1 else (low + high) // 2
    nearest = max(below, key=lambda p: p.stop) if below else min(above, key=lambda p: p.stop)
    move = min(MAX_MOVE, max(1, round(100 * abs(landing - nearest.step0) * STEPS_PER_POINT)))
    stop = nearest.stop + move if below else nearest.stop - move
    return None if stop < 1 else stop


def is_judged(step0: float) -> bool:
    return JUDGED[0] <= step0 <= JUDGED[1]


def failures(rows: Sequence[dict]) -> list[dict]:
    """The runs that start within ``JUDGED`` and gain fewer than ``MIN_GAIN`` (in points: 100 x)."""
    return [r for r in rows if is_judged(r["accuracy_step0"]) and r["gain_points"] < 100 * MIN_GAIN - 1e-9]


def plans(seeds: Sequence[int], landings: Sequence[float], one_core_seeds: Sequence[int]) -> list[Plan]:
    forced = [Plan(f"forced {landing:.0%}, seed {seed}", seed, landing) for seed in seeds for landing in landings]
    configured = [Plan(f"as configured, seed {seed}", seed) for seed in seeds]
    slow = [Plan(f"one core, seed {seed}", seed, one_core=True) for seed in one_core_seeds]
    return forced + configured + slow


@contextmanager
def one_core(active: bool) -> Iterator[None]:
    """The runs started inside use one torch thread on one core (inherited affinity and ``OMP_NUM_THREADS``)."""
    if not active:
        yield
        return
    affinity, threads = os.sched_getaffinity(0), os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    os.sched_setaffinity(0, {min(affinity)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, affinity)
        if threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = threads


def _forced_flags(seed: int, stop: int) -> list[str]:
    """The quick start with its warm start stopped at step ``stop`` (its first check, which any accuracy passes)."""
    return [*common.seed_overrides(seed), f"{POLICY}.target_accuracy=0.0", f"{POLICY}.eval_every={stop}"]


def _fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)  # an interrupted run's folder would make the next one version_1
    return path


def _folder(scratch: Path, seed: int, stop: int) -> Path:
    return scratch / f"seed{seed}-stop{stop}"


def probe(seed: int, stop: int, scratch: Path) -> Probe:
    """Train the warm start to step ``stop`` into its own cache and measure held-out accuracy at RL step 0."""
    where = _folder(scratch, seed, stop)
    result = common.run_fit(_fresh(where / "probe"), [*_forced_flags(seed, stop), "--trainer.max_steps=1"],
                            where / "cache")  # fmt: skip
    return Probe(seed, stop, result["steps"][0]["eval/accuracy"])


def find_landing(plan: Plan, probes: list[Probe], scratch: Path) -> Probe:
    """Probe stops (recording each in ``probes`` and the progress file) until one lands within the tolerance."""
    mine = [p for p in probes if p.seed == plan.seed]
    for _ in range(MAX_PROBES):
        stop = next_stop(mine, plan.landing)
        if stop is None or any(p.stop == stop for p in mine):
            break
        found = probe(plan.seed, stop, scratch)
        print(f"probe: seed {found.seed}, warm start stopped at step {stop} -> step 0 {found.step0:.1%}", flush=True)
        mine.append(found)
        probes.append(found)
        common.append_progress(PROGRESS, {"probe": found._asdict()})
    return closest(mine, plan.landing)


def warm_start_report(cache: Path) -> dict:
    report = json.loads(next(cache.glob("warm_start/*/warm_start.json")).read_text())
    return {"warm_start_steps": report["steps"], "warm_start_accuracy": report["accuracy"],
            "warm_start_seconds": report["seconds"]}  # fmt: skip


def run_plan(plan: Plan, probes: list[Probe], scratch: Path) -> dict:
    """One full quick start: the summary row, with its per-step ``curves``."""
    if plan.landing is None:
        rule, flags = "target 30%", common.seed_overrides(plan.seed)
        cache = _fresh(scratch / plan.name.replace(", ", "-").replace(" ", "_") / "cache")  # trained in the run
    else:
        chosen = find_landing(plan, probes, scratch)
        rule, cache = f"step {chosen.stop}", _folder(scratch, plan.seed, chosen.stop) / "cache"
        flags = _forced_flags(plan.seed, chosen.stop)
    load = os.getloadavg()[0]
    with one_core(plan.one_core):
        result = common.run_fit(_fresh(cache.parent / f"run-{'one-core' if plan.one_core else 'cores'}"), flags, cache)
    steps = result["steps"]
    evaluations = [(step, values["eval/accuracy"]) for step, values in sorted(steps.items()) if "eval/accuracy" in values]
    warm = warm_start_report(cache)
    fit_seconds = round(result["seconds"], 1)
    return {
        "run": plan.name, "seed": plan.seed, "landing": plan.landing if plan.landing is not None else math.nan,
        "one_core": plan.one_core, "warm_start_rule": rule, **warm,
        "accuracy_step0": evaluations[0][1], "accuracy_end": evaluations[-1][1],
        "accuracy_best": max(a for _, a in evaluations), "steps": evaluations[-1][0],
        "gain_points": round(100 * (evaluations[-1][1] - evaluations[0][1]), 1), "fit_seconds": fit_seconds,
        # a forced run found its warm start cached by the probe: add the warm start for the cold-cache time
        "cold_seconds": fit_seconds + (warm["warm_start_seconds"] if plan.landing is not None else 0.0),
        "load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2),
        "curves": [{"run": plan.name, "step": step, **{c: values.get(c, math.nan) for c in CURVE_COLUMNS}}
                   for step, values in sorted(steps.items())],
    }  # fmt: skip


COLUMNS = {
    "run": "{run}", "warm start stops at": "{warm_start_rule} ({warm_start_steps})",
    "step 0": "{accuracy_step0:.1%}", "end": "{accuracy_end:.1%}", "best": "{accuracy_best:.1%}",
    "gain (points)": "{gain_points:+.1f}", "run s": "{fit_seconds:.0f}", "cold-cache s": "{cold_seconds:.0f}",
    "load": "{load_before:.1f}",
}  # fmt: skip


def table(rows: Sequence[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(template.format(**row) for template in COLUMNS.values()) + " |" for row in rows]
    return "\n".join(lines)


def verdict(rows: Sequence[dict]) -> str:
    """One paragraph: how many runs were judged, their range of starts, ends and gains, and which failed."""
    judged = [r for r in rows if is_judged(r["accuracy_step0"])]
    if not judged:
        return f"no run started within {JUDGED[0]:.0%}-{JUDGED[1]:.0%}: nothing judged"
    starts, ends, gains = ([r[k] for r in judged] for k in ("accuracy_step0", "accuracy_end", "gain_points"))
    text = (f"{len(judged)} of {len(rows)} runs started within {JUDGED[0]:.0%}-{JUDGED[1]:.0%} "
            f"({min(starts):.1%}-{max(starts):.1%}); they ended at {min(ends):.1%}-{max(ends):.1%}, gaining "
            f"{min(gains):+.1f} to {max(gains):+.1f} points")  # fmt: skip
    failed = failures(rows)
    if failed:
        return text + f"; below +{100 * MIN_GAIN:.0f}: " + ", ".join(r["run"] for r in failed)
    return text + f": every one gained at least +{100 * MIN_GAIN:.0f}"


def plot(rows: Sequence[dict], curves: Sequence[dict], path: Path) -> None:
    try:
        figure, (accuracy_axis, reward_axis) = common.grid_figure(1, 2, (13, 5))
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    import matplotlib

    colors = matplotlib.colormaps["viridis"]
    for row in rows:
        mine = [c for c in curves if c["run"] == row["run"]]
        evaluated = [c for c in mine if not math.isnan(c["eval/accuracy"])]
        style = {"color": colors((row["accuracy_step0"] - 0.2) / 0.3), "linestyle": ":" if row["one_core"] else "-"}
        label = f"{row['run']} ({row['accuracy_step0']:.1%})"
        accuracy_axis.plot([c["step"] for c in evaluated], [100 * c["eval/accuracy"] for c in evaluated], marker="o",
                           markersize=3, label=label, **style)  # fmt: skip
        rewards = common.smooth([c["rollout/reward_mean"] for c in mine], 50)
        reward_axis.plot([c["step"] for c in mine], rewards, label=label, **style)
    common.finish_axes([accuracy_axis, reward_axis], [("optimizer step", "held-out greedy accuracy (%)"),
                                                     ("optimizer step", "training reward (moving avg. 50)")])
    common.save_figure(figure, "The quick start from forced warm-start landings (dotted: one core)", path)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--landings", type=float, nargs="+", default=list(LANDINGS),
                        help="held-out accuracies at step 0 to force (default: %(default)s)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds of the forced runs and of the "
                        "runs as configured (the warm start's, the RL run's, the prompts'; default: %(default)s)")
    parser.add_argument("--one-core-seeds", type=int, nargs="*", default=[0, 1],
                        help="seeds of the runs as configured with one thread on one core (default: %(default)s)")
    parser.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()) / "gspo-quickstart-landing",
                        help="working folders and warm-start caches, kept for a resume (default: %(default)s)")
    parser.add_argument("--replot", action="store_true", help="the table and plot from the committed CSVs")
    args = parser.parse_args()
    bad = [value for value in args.landings if not 0.0 < value < 1.0]
    if bad:
        parser.error(f"--landings: each must be a held-out accuracy in (0, 1), got {bad}")
    return args


def _load_rows(path: Path) -> list[dict]:
    import csv

    def value(text: str):
        if text in ("True", "False"):
            return text == "True"
        try:
            number = float(text)
        except ValueError:
            return text
        return int(number) if number.is_integer() and "." not in text else number

    with path.open() as handle:
        return [{key: value(text) for key, text in row.items()} for row in csv.DictReader(handle)]


def main() -> int:
    args = arguments()
    if args.replot:
        rows, curves = _load_rows(HERE / "results.csv"), _load_rows(HERE / "curves.csv")
    else:
        done = common.read_progress(PROGRESS)
        probes = [Probe(**record["probe"]) for record in done if "probe" in record]
        finished = {record["run"]["run"]: record["run"] for record in done if "run" in record}
        for plan in plans(args.seeds, args.landings, args.one_core_seeds):
            if plan.name not in finished:
                finished[plan.name] = run_plan(plan, probes, args.scratch)
                common.append_progress(PROGRESS, {"run": finished[plan.name]})
            print({k: v for k, v in finished[plan.name].items() if k != "curves"}, flush=True)
        rows = [{k: v for k, v in run.items() if k != "curves"} for run in finished.values()]
        curves = [row for run in finished.values() for row in run["curves"]]
        for path, table_rows in ((HERE / "results.csv", rows), (HERE / "curves.csv", curves),
                                 (HERE / "probes.csv", [p._asdict() for p in probes])):  # fmt: skip
            common.write_csv(path, table_rows)
        PROGRESS.unlink(missing_ok=True)
    plot(rows, curves, HERE / "landing.png")
    text = f"machine: {common.machine()}\n\n{table(rows)}\n\n{verdict(rows)}\n"
    print("\n" + text)
    if not args.replot:
        (HERE / "output.txt").write_text("python experiments/quickstart_landing/run.py\n\n" + text)
    return 1 if failures(rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Sandbox throughput: programs/s of ``CodeTests`` with ``max_workers=2``, this tree against an earlier commit.

    python experiments/bench/sandbox.py                       # ~2 minutes on 2 CPU cores
    python experiments/bench/sandbox.py --before ff69d11 --reps 5 --passes 4

The workload is the packaged code sample (``gspo_lightning/data/samples/code.jsonl``): each problem's reference
solution, fenced as a model would write it, scored by ``CodeTests(max_workers=2)`` with its default limits and
``isolation: required``. One pass scores the 12 problems once: 10 call problems (one program run each) and 2
stdio problems (one run per test, 5 in all), so 15 sandboxed programs per pass; every score must be 1.0.

Both sides run in fresh processes from the same interpreter: ``after`` imports this tree's ``gspo_lightning``,
``before`` the one of ``--before`` (extracted with ``git archive`` into a temporary directory). Building the
reward (its isolation probe) is not timed; each side does one untimed pass first, then ``--passes`` timed
ones. Repetitions alternate which side goes first, so a change of load on the shared machine hits both alike.
Reported: programs/s and seconds per program (median over repetitions), and the ratio after / before of the
seconds per program, which the issue bounds at 1.5.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "gspo_lightning/data/samples/code.jsonl"
OUTPUT = Path(__file__).with_name("sandbox_output.txt")
LIMIT = 1.5  # the bound on the per-program overhead, after / before


def measure(passes: int) -> dict:
    """In a side's own process: time ``passes`` passes over the sample; return programs and seconds."""
    from gspo_lightning.rewards import CodeTests

    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
    completions = [f"Here is my solution:\n```python\n{row['solution']}```" for row in rows]
    columns = {"tests": [row["tests"] for row in rows], "entry_point": [row["entry_point"] for row in rows]}
    programs_per_pass = sum(
        1 if test_kind == "input" else count for test_kind, count in map(_runs_of, columns["tests"])
    )
    reward = CodeTests(max_workers=2)
    assert reward([""] * len(rows), completions, **columns) == [1.0] * len(rows), "warm-up pass failed"
    start = time.perf_counter()
    for _ in range(passes):
        scores = reward([""] * len(rows), completions, **columns)
        assert scores == [1.0] * len(rows), f"a reference solution failed: {scores}"
    seconds = time.perf_counter() - start
    return {"programs": programs_per_pass * passes, "seconds": seconds}


def _runs_of(tests: str) -> tuple[str, int]:
    parsed = json.loads(tests)
    return ("input", 1) if "input" in parsed[0] else ("stdin", len(parsed))


def run_side(package_root: Path, passes: int) -> dict:
    """One measurement in a fresh process whose ``gspo_lightning`` comes from ``package_root``."""
    code = (
        f"import sys, json; sys.path.insert(0, {str(package_root)!r}); sys.path.insert(1, {str(ROOT)!r})\n"
        "import gspo_lightning\n"
        f"assert gspo_lightning.__file__.startswith({str(package_root)!r}), gspo_lightning.__file__\n"
        "from experiments.bench.sandbox import measure\n"
        f"print(json.dumps(measure({passes})))\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=package_root, check=False
    )
    if completed.returncode != 0:
        raise RuntimeError(f"the side in {package_root} failed:\n{completed.stderr[-3000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def extract(commit: str, into: Path) -> Path:
    """``gspo_lightning`` as it was at ``commit``, unpacked under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "gspo_lightning"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--before", default="ff69d11", help="commit to compare with (default: issue 15's start)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of each side")
    parser.add_argument("--passes", type=int, default=4, help="timed passes over the sample per repetition")
    args = parser.parse_args()
    started = time.perf_counter()
    results: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="gspo-bench-") as scratch:
        roots = {"before": extract(args.before, Path(scratch)), "after": ROOT}
        for rep in range(args.reps):
            order = ("before", "after") if rep % 2 == 0 else ("after", "before")
            for side in order:
                results[side].append(run_side(roots[side], args.passes))
    report = format_report(args, results, time.perf_counter() - started)
    print(report)
    OUTPUT.write_text(report)
    return 0 if _ratio(results) <= LIMIT else 1


def _seconds_per_program(runs: list[dict]) -> float:
    return statistics.median(run["seconds"] / run["programs"] for run in runs)


def _ratio(results: dict[str, list[dict]]) -> float:
    return _seconds_per_program(results["after"]) / _seconds_per_program(results["before"])


def format_report(args: argparse.Namespace, results: dict[str, list[dict]], took_s: float) -> str:
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    lines = [
        f"commit {head.stdout.strip()} (after) vs {args.before} (before): python experiments/bench/sandbox.py "
        f"--before {args.before} --reps {args.reps} --passes {args.passes}",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"uid {os.getuid()}; CodeTests(max_workers=2), default limits, isolation required",
        "",
        "| side | programs/s (median) | ms per program (median) | min-max ms per program |",
        "|---|---:|---:|---:|",
    ]
    for side in ("before", "after"):
        per_program = [run["seconds"] / run["programs"] * 1000 for run in results[side]]
        median = statistics.median(per_program)
        lines.append(f"| {side} | {1000 / median:.1f} | {median:.1f} | {min(per_program):.1f}-{max(per_program):.1f} |")
    ratio = _ratio(results)
    verdict = "within" if ratio <= LIMIT else "OVER"
    lines += ["", f"after / before, seconds per program: {ratio:.2f}x ({verdict} the {LIMIT}x bound)"]
    lines.append(f"(took {took_s:.0f} s)")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

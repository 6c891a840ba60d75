"""Code rewards: run each completion's program against the problem's unit tests in a sandbox.

The tests column holds, per problem, a list of tests (or that list as a JSON string). Two kinds, mixable:

- call tests ``{"input": [arg, ...], "output": value}``: the solution's ``entry_point`` function is called with
  the arguments; its return value must equal ``output`` after a JSON round trip (tuples become lists; floats
  compare with a relative tolerance);
- stdio tests ``{"stdin": "...", "stdout": "..."}``: the program runs with that standard input; its output must
  equal ``stdout`` up to trailing white space on each line and trailing blank lines.

Expected outputs never enter the sandbox (see ``code_harness.py``), so a program cannot fake a pass. Whatever a
program prints (huge numbers, deep nesting, invalid UTF-8, binary garbage, megabytes) costs its own sample at
most: a line that cannot be read is no report, an error while scoring one sample scores it 0 with the reason
logged (naming that sample), and the batch's other samples are scored as usual.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gspo_lightning.sandbox import ISOLATIONS, Isolation, Sandbox, SandboxLimits, SandboxResult, SandboxUnavailableError
from gspo_lightning.sandbox.spec import limits_problem

logger = logging.getLogger(__name__)

_HARNESS = Path(__file__).with_name("code_harness.py").read_text()
_FENCED = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str) -> str:
    """The program in a completion: its last fenced code block (```python ... ```), else the whole text."""
    blocks = _FENCED.findall(completion)
    return blocks[-1] if blocks else completion


@dataclass(frozen=True)
class _Tests:
    """One problem's tests, split by kind."""

    call_inputs: list[list[Any]]
    call_outputs: list[Any]
    stdio: list[tuple[str, str]]

    @property
    def count(self) -> int:
        return len(self.call_inputs) + len(self.stdio)


def parse_tests(tests: Any, row: int = 0) -> _Tests:
    """Validate one problem's tests (a list of test dicts, or that list as JSON); errors name the row."""
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as error:
            raise ValueError(f"code tests of row {row} are not valid JSON: {error}") from None
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"code tests of row {row} must be a non-empty list of tests, got {tests!r:.200}")
    parsed = _Tests([], [], [])
    for test in tests:
        if isinstance(test, dict) and set(test) == {"input", "output"} and isinstance(test["input"], list):
            parsed.call_inputs.append(test["input"])
            parsed.call_outputs.append(json.loads(json.dumps(test["output"])))
        elif isinstance(test, dict) and set(test) == {"stdin", "stdout"}:
            parsed.stdio.append((str(test["stdin"]), str(test["stdout"])))
        else:
            raise ValueError(
                f"code test {test!r:.200} of row {row} must be {{'input': [args], 'output': value}} "
                "or {'stdin': text, 'stdout': text}"
            )
    return parsed


def outputs_match(actual: Any, expected: Any, rel_tol: float = 1e-6) -> bool:
    """Equality of JSON values, with a relative tolerance for floats (bools never equal numbers)."""
    if isinstance(expected, bool) or isinstance(actual, bool):
        return type(actual) is type(expected) and actual == expected
    if isinstance(expected, int | float) and isinstance(actual, int | float):
        if isinstance(expected, int) and isinstance(actual, int):
            return actual == expected
        try:
            return math.isclose(actual, expected, rel_tol=rel_tol, abs_tol=rel_tol * 1e-3)
        except OverflowError:  # an integer too large for a float: not close to any float
            return False
    if isinstance(expected, list) and isinstance(actual, list):
        return len(actual) == len(expected) and all(map(outputs_match, actual, expected))
    if isinstance(expected, dict) and isinstance(actual, dict):
        return actual.keys() == expected.keys() and all(outputs_match(actual[k], expected[k]) for k in expected)
    return type(actual) is type(expected) and actual == expected


def _normalise_output(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


@dataclass(frozen=True)
class HarnessReports:
    """The harness's result lines, by test index, and how many lines could not be read (with the first why)."""

    by_test: dict[int, list[dict]]
    unreadable: int = 0
    first_problem: str | None = None


def read_reports(stdout: str) -> HarnessReports:
    """Parse each line that could be a report; a line the JSON parser rejects (invalid, a 5,000-digit number,
    100k nested brackets) is counted as unreadable, never raised."""
    by_test: dict[int, list[dict]] = {}
    unreadable, first_problem = 0, None
    for line in stdout.splitlines():
        if not line.startswith("{"):
            continue
        try:
            report = json.loads(line)
        except (ValueError, RecursionError) as error:  # JSONDecodeError is a ValueError
            unreadable += 1
            first_problem = first_problem or f"{type(error).__name__}: {str(error)[:200]}"
            continue
        if isinstance(report, dict) and type(report.get("test")) is int:
            by_test.setdefault(report["test"], []).append(report)
    return HarnessReports(by_test, unreadable, first_problem)


def count_call_passes(stdout: str, expected: list[Any]) -> int:
    """Tests whose single reported result equals the expected output (a test reported twice fails)."""
    reports = read_reports(stdout).by_test
    passed = 0
    for index, want in enumerate(expected):
        found = reports.get(index, [])
        passed += len(found) == 1 and "result" in found[0] and outputs_match(found[0]["result"], want)
    return passed


def run_problems(result: SandboxResult, limits: SandboxLimits) -> list[str]:
    """Why a run may have scored less than it could, for the logs (empty for a run that ended normally)."""
    problems = []
    if result.error is not None:
        problems.append(result.error)
    if result.timed_out:
        problems.append(f"killed at the wall-clock limit ({limits.wall_time_s} s)")
    if result.memory_exceeded:
        problems.append(f"a process was killed at the run's memory cap ({limits.memory_mb} MiB)")
    if result.output_truncated:
        problems.append(f"output cut at {limits.output_bytes} bytes")
    return problems


class CodeTests:
    """Fraction of a problem's unit tests that the completion's program passes, run in a :class:`Sandbox`.

    Args:
        tests_column: column holding each problem's tests (see the module docstring for the format).
        entry_point_column: column naming the function that call tests call (unused by stdio tests).
        isolation: ``required`` (default: refuse to run without the sandbox's namespaces, minimal root and
            system-call filter), ``best_effort`` (run with what the machine has, warning what is missing) or
            ``off`` (trusted code only).
        wall_time_s: wall-clock limit per program run (per completion for call tests, per test for stdio).
        cpu_time_s: CPU-time limit per process of a run.
        memory_mb: memory of a whole run (every process, its files, its output) and address space per process.
        disk_mb: bytes a run may write (working directory and ``/tmp`` together).
        max_files: files and folders a run may create.
        max_workers: programs run at once (threads, each waiting on a sandboxed process); default: CPU count.
    """

    def __init__(
        self,
        tests_column: str = "tests",
        entry_point_column: str = "entry_point",
        isolation: Isolation = "required",
        wall_time_s: float = 10.0,
        cpu_time_s: int = 5,
        memory_mb: int = 512,
        disk_mb: int = 64,
        max_files: int = 4096,
        max_workers: int | None = None,
    ) -> None:
        if max_workers is not None and (type(max_workers) is not int or max_workers < 1):
            raise ValueError(f"CodeTests.max_workers must be >= 1 (or None for the CPU count), got {max_workers!r}")
        if isolation not in ISOLATIONS:
            raise ValueError(f"CodeTests.isolation must be one of {list(ISOLATIONS)}, got {isolation!r}")
        settings = dict(wall_time_s=wall_time_s, cpu_time_s=cpu_time_s, memory_mb=memory_mb, disk_mb=disk_mb,
                        max_files=max_files)  # fmt: skip
        problem = limits_problem(settings)
        if problem is not None:
            raise ValueError(f"CodeTests.{problem}")
        self.tests_column = tests_column
        self.entry_point_column = entry_point_column
        self.max_workers = max_workers or os.cpu_count() or 1
        self.sandbox = Sandbox(SandboxLimits(**settings), isolation)
        self.sandbox.check()  # fail at configuration time, not at the first rollout

    @property
    def required_columns(self) -> tuple[str, ...]:
        """The data set columns this reward reads (checked when the data is set up, before the model loads); the
        entry point column is optional (stdin/stdout tests need none)."""
        return (self.tests_column,)

    def __call__(self, prompts: list[Any], completions: list[str], **columns: list[Any]) -> list[float]:
        if self.tests_column not in columns:
            raise KeyError(f"CodeTests needs the column {self.tests_column!r}; the data set has {sorted(columns)}")
        tests = [parse_tests(value, row) for row, value in enumerate(columns[self.tests_column])]
        entry_points = columns.get(self.entry_point_column, [None] * len(completions))
        for row, (problem, entry_point) in enumerate(zip(tests, entry_points, strict=True)):
            if problem.call_inputs and not entry_point:
                raise KeyError(
                    f"row {row} has call tests but no entry point in column {self.entry_point_column!r}"
                )
        programs = [extract_code(completion) for completion in completions]
        with ThreadPoolExecutor(self.max_workers) as pool:
            return list(pool.map(self._score, range(len(programs)), programs, tests, entry_points))

    def _score(self, sample: int, program: str, tests: _Tests, entry_point: str | None) -> float:
        """One sample's score; whatever goes wrong while scoring it costs this sample only."""
        problems: list[str] = []
        try:
            passed = self._run_calls(program, tests, entry_point, problems) + self._run_stdio(program, tests, problems)
        except SandboxUnavailableError:
            raise
        except Exception as error:  # a hostile program's output, or anything else about this one sample
            logger.warning("CodeTests: sample %d scored 0: %s: %s", sample, type(error).__name__, str(error)[:500])
            return 0.0
        if problems:
            logger.info("CodeTests: sample %d (%d/%d passed): %s", sample, passed, tests.count, "; ".join(problems))
        return passed / tests.count

    def _run_calls(self, program: str, tests: _Tests, entry_point: str | None, problems: list[str]) -> int:
        if not tests.call_inputs:
            return 0
        inputs = json.dumps({"entry_point": entry_point, "inputs": tests.call_inputs})
        files = {"solution.py": program, "harness.py": _HARNESS, "inputs.json": inputs}
        result = self.sandbox.run(files, "harness.py")
        problems += run_problems(result, self.sandbox.limits)
        reports = read_reports(result.stdout)
        if reports.unreadable:
            problems.append(f"{reports.unreadable} report line(s) could not be read ({reports.first_problem})")
        return count_call_passes(result.stdout, tests.call_outputs)

    def _run_stdio(self, program: str, tests: _Tests, problems: list[str]) -> int:
        passed = 0
        for stdin, expected in tests.stdio:
            result = self.sandbox.run({"solution.py": program}, "solution.py", stdin=stdin)
            problems += run_problems(result, self.sandbox.limits)
            passed += result.ok and _normalise_output(result.stdout) == _normalise_output(expected)
        return passed

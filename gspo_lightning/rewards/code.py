"""Code rewards: run each completion's program against the problem's unit tests in a sandbox.

The tests column holds, per problem, a list of tests (or that list as a JSON string). Two kinds, mixable:

- call tests ``{"input": [arg, ...], "output": value}``: the solution's ``entry_point`` function is called with
  the arguments; its return value must equal ``output`` after a JSON round trip (tuples become lists; floats
  compare with a relative tolerance);
- stdio tests ``{"stdin": "...", "stdout": "..."}``: the program runs with that standard input; its output must
  equal ``stdout`` up to trailing white space on each line and trailing blank lines.

Expected outputs never enter the sandbox (see ``code_harness.py``), so a program cannot fake a pass.
"""

from __future__ import annotations

import json
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gspo_lightning.sandbox import Isolation, Sandbox, SandboxLimits

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
        return math.isclose(actual, expected, rel_tol=rel_tol, abs_tol=rel_tol * 1e-3)
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


def count_call_passes(stdout: str, expected: list[Any]) -> int:
    """Tests whose single reported result equals the expected output (a test reported twice fails)."""
    reports: dict[int, list[dict]] = {}
    for line in stdout.splitlines():
        try:
            report = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(report, dict) and isinstance(report.get("test"), int):
            reports.setdefault(report["test"], []).append(report)
    passed = 0
    for index, want in enumerate(expected):
        found = reports.get(index, [])
        passed += len(found) == 1 and "result" in found[0] and outputs_match(found[0]["result"], want)
    return passed


class CodeTests:
    """Fraction of a problem's unit tests that the completion's program passes, run in a :class:`Sandbox`.

    Args:
        tests_column: column holding each problem's tests (see the module docstring for the format).
        entry_point_column: column naming the function that call tests call (unused by stdio tests).
        isolation: ``required`` (default: refuse to run without network/mount/PID namespaces), ``best_effort``
            or ``off`` (trusted code only).
        wall_time_s: wall-clock limit per program run (per completion for call tests, per test for stdio).
        cpu_time_s: CPU-time limit per program run.
        memory_mb: address-space limit per process.
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
        max_workers: int | None = None,
    ) -> None:
        if max_workers is not None and max_workers < 1:
            raise ValueError(f"max_workers must be >= 1 (or None for the CPU count), got {max_workers}")
        self.tests_column = tests_column
        self.entry_point_column = entry_point_column
        self.max_workers = max_workers or os.cpu_count() or 1
        limits = SandboxLimits(wall_time_s=wall_time_s, cpu_time_s=cpu_time_s, memory_mb=memory_mb)
        self.sandbox = Sandbox(limits, isolation)
        self.sandbox.check()  # fail at configuration time, not at the first rollout

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
            calls = pool.map(self._run_calls, programs, tests, entry_points)
            stdio = pool.map(self._run_stdio, programs, tests)
            passed = [a + b for a, b in zip(calls, stdio, strict=True)]
        return [count / problem.count for count, problem in zip(passed, tests, strict=True)]

    def _run_calls(self, program: str, tests: _Tests, entry_point: str | None) -> int:
        if not tests.call_inputs:
            return 0
        inputs = json.dumps({"entry_point": entry_point, "inputs": tests.call_inputs})
        files = {"solution.py": program, "harness.py": _HARNESS, "inputs.json": inputs}
        result = self.sandbox.run(files, "harness.py")
        return count_call_passes(result.stdout, tests.call_outputs)

    def _run_stdio(self, program: str, tests: _Tests) -> int:
        passed = 0
        for stdin, expected in tests.stdio:
            result = self.sandbox.run({"solution.py": program}, "solution.py", stdin=stdin)
            passed += result.ok and _normalise_output(result.stdout) == _normalise_output(expected)
        return passed

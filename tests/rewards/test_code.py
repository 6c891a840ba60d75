"""CodeTests: programs are scored by the fraction of unit tests they pass, in the sandbox, in parallel."""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path

import pytest

from gspo_lightning.rewards.code import (
    CodeTests,
    count_call_passes,
    extract_code,
    outputs_match,
    parse_tests,
    read_reports,
)
from gspo_lightning.rewards.scoring import score_completions
from gspo_lightning.sandbox import isolation_unavailable_reason
from gspo_lightning.sandbox.cgroups import cgroup_unavailable_reason

SAMPLE = Path(__file__).resolve().parents[2] / "gspo_lightning/data/samples/code.jsonl"
needs_sandbox = pytest.mark.skipif(isolation_unavailable_reason() is not None, reason="no namespaces here")

ADD_TESTS = json.dumps([{"input": [1, 2], "output": 3}, {"input": [2, 2], "output": 4}, {"input": [0, 5], "output": 5}])


@pytest.fixture(scope="module")
def reward():
    return CodeTests(wall_time_s=3.0, cpu_time_s=2, memory_mb=256)


def score(reward, program: str, tests: str = ADD_TESTS, entry_point: str = "add") -> float:
    return reward(["p"], [program], tests=[tests], entry_point=[entry_point])[0]


def test_extract_code_takes_the_last_fenced_block_or_the_whole_text():
    text = "Idea:\n```python\nx = 1\n```\nBetter:\n```\ndef f():\n    return 2\n```\n"
    assert extract_code(text) == "def f():\n    return 2\n"
    assert extract_code("def f(): return 1") == "def f(): return 1"


def test_outputs_match_compares_json_values_with_a_float_tolerance():
    assert outputs_match([1, 2.0000000001], [1, 2.0])
    assert not outputs_match([1, 2.1], [1, 2.0])
    assert outputs_match(2.0, 2) and not outputs_match(True, 1) and not outputs_match(1, True)
    assert outputs_match({"a": [1]}, {"a": [1]}) and not outputs_match({"a": 1}, {"b": 1})
    assert not outputs_match("1", 1) and outputs_match(None, None)
    assert not outputs_match(10**400, 1.5)  # too large for a float: not close, not an OverflowError


def test_report_lines_a_parser_rejects_are_counted_not_raised():
    hostile = "\n".join([
        '{"test": 0, "result": ' + "9" * 5000 + "}",  # ValueError: int parsing limit
        '{"test": 1, "result": ' + "[" * 100_000 + "}",  # RecursionError
        '{"test": 2, "result": \udcff}',
        '{"test": true, "result": 4}',  # a bool is no test index
        '{"test": 1, "result": 4}',
    ])  # fmt: skip
    reports = read_reports(hostile)
    assert reports.unreadable == 3 and "ValueError" in reports.first_problem
    assert list(reports.by_test) == [1]
    assert count_call_passes(hostile, [3, 4]) == 1


def test_a_test_reported_twice_or_forged_does_not_pass():
    expected = [3, 4]
    honest = '{"test": 0, "result": 3}\n{"test": 1, "result": 5}\n'
    assert count_call_passes(honest, expected) == 1
    guessing = '{"test": 1, "result": 4}\n{"test": 1, "result": 5}\n'  # two claims for one test
    assert count_call_passes(guessing, expected) == 0
    assert count_call_passes('noise\n{"test": 0, "error": "ValueError"}\n', expected) == 0


@pytest.mark.parametrize(
    "bad", ['[{"input": 1, "output": 2}]', "[]", "not json", '[{"stdin": "1"}]'], ids=["input", "empty", "json", "kind"]
)
def test_malformed_tests_name_the_row(bad):
    with pytest.raises(ValueError, match="row 7"):
        parse_tests(bad, row=7)


@needs_sandbox
def test_fraction_of_passed_call_tests(reward):
    assert score(reward, "def add(a, b):\n    return a + b") == 1.0
    assert score(reward, "def add(a, b):\n    return a + b if a != 0 else -1") == pytest.approx(2 / 3)
    assert score(reward, "def add(a, b):\n    raise ValueError") == 0.0
    assert score(reward, "syntax error here") == 0.0
    assert score(reward, "def other(a, b):\n    return a + b") == 0.0


@needs_sandbox
def test_a_program_that_cannot_see_the_expected_outputs_cannot_forge_them(reward):
    forger = (
        "import os, json\n"
        "for i in range(3):\n    os.write(1, (json.dumps({'test': i, 'result': 99}) + '\\n').encode())\n"
        "os._exit(0)\n"
    )
    assert score(reward, forger) == 0.0


@needs_sandbox
def test_stdio_tests_compare_output_up_to_trailing_space(reward):
    tests = json.dumps([{"stdin": "2 3\n", "stdout": "5\n"}, {"stdin": "1 1\n", "stdout": "2"}])
    program = "a, b = map(int, input().split())\nprint(a + b, '  ')\nprint()"
    assert reward(["p"], [program], tests=[tests], entry_point=[""]) == [1.0]
    assert reward(["p"], ["print(5)"], tests=[tests], entry_point=[""]) == [0.5]


@needs_sandbox
def test_every_sample_problem_is_solved_by_its_reference_and_not_by_a_wrong_program(reward):
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
    columns = {name: [row[name] for row in rows] for name in ("tests", "entry_point")}
    fenced = [f"Here you go:\n```python\n{row['solution']}```" for row in rows]
    assert reward([""] * len(rows), fenced, **columns) == [1.0] * len(rows)
    assert reward([""] * len(rows), ["print(-123456)"] * len(rows), **columns) == [0.0] * len(rows)


@needs_sandbox
def test_reading_the_trainers_environment_scores_zero(reward, monkeypatch):
    monkeypatch.setenv("GSPO_TEST_SECRET", "s3cret")
    tests = json.dumps([{"input": [], "output": "s3cret"}])
    program = "import os\ndef leak():\n    return os.environ.get('GSPO_TEST_SECRET')"
    assert score(reward, program, tests, "leak") == 0.0


@needs_sandbox
def test_a_batch_runs_in_parallel():
    reward = CodeTests(wall_time_s=5.0, max_workers=8)
    program = "import time\ntime.sleep(1)\ndef add(a, b):\n    return a + b"
    start = time.monotonic()
    assert reward(["p"] * 8, [program] * 8, tests=[ADD_TESTS] * 8, entry_point=["add"] * 8) == [1.0] * 8
    assert time.monotonic() - start < 4.0  # eight 1 s programs one after another would take over 8 s


@needs_sandbox
def test_the_reward_pickles_for_process_isolated_reward_workers(reward):
    copy = pickle.loads(pickle.dumps(reward))
    assert score(copy, "def add(a, b):\n    return a + b") == 1.0


def test_missing_columns_and_bad_settings_are_named():
    with pytest.raises(ValueError, match="max_workers must be >= 1"):
        CodeTests(max_workers=0)
    with pytest.raises(ValueError, match="isolation must be one of"):
        CodeTests(isolation="sometimes")
    reward = CodeTests(isolation="off")
    with pytest.raises(KeyError, match="needs the column 'tests'"):
        reward(["p"], ["x"], answer=["1"])
    with pytest.raises(KeyError, match="no entry point"):
        reward(["p"], ["x"], tests=[ADD_TESTS], entry_point=[""])


@needs_sandbox
@pytest.mark.slow
def test_code_sample_config_trains_end_to_end_with_sandboxed_rewards(tmp_path):
    import csv
    import subprocess
    import sys

    config = Path(__file__).resolve().parents[2] / "configs/code_sample.yaml"
    command = [sys.executable, "-m", "gspo_lightning", "fit", "-c", str(config), "--trainer.max_steps=2"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(next(tmp_path.glob("runs/code_sample/version_*/metrics.csv"))) as handle:
        rows = list(csv.DictReader(handle))
    scored = [float(row["rollout/reward/CodeTests"]) for row in rows if row.get("rollout/reward/CodeTests")]
    assert scored and all(0.0 <= value <= 1.0 for value in scored)
    assert any(row.get("eval/accuracy") for row in rows)


def _reporting(result: str) -> str:
    """A program that prints one harness-like report line whose result is the Python expression ``result``."""
    return f"import os\nos.write(1, b'{{\"test\": 0, \"result\": ' + {result} + b'}}\\n')\nos._exit(0)"


HOSTILE_OUTPUTS = {
    "a 5000-digit integer": _reporting("b'9' * 5000"),
    "100k nested brackets": _reporting("b'[' * 100000"),
    "binary garbage": "import os\nos.write(1, bytes(range(256)) * 4000)\nos._exit(0)",
    "an integer too large for a float": _reporting("b'1' + b'0' * 400"),
}
MEAN_TESTS = json.dumps([{"input": [[1, 2]], "output": 1.5}])


@needs_sandbox
@pytest.mark.parametrize("reraise", ["raise", "skip"])
def test_a_hostile_output_costs_its_own_sample_and_the_log_names_it(reward, reraise, caplog):
    """What ended the run under reward_errors raise (or lost the whole batch under skip) now scores one sample 0."""
    honest = "def mean(xs):\n    return sum(xs) / len(xs)"
    completions = [honest, *HOSTILE_OUTPUTS.values(), honest]
    count = len(completions)
    caplog.set_level("INFO", logger="gspo_lightning.rewards.code")
    total, _ = score_completions(
        [reward], [1.0], ["p"] * count, completions, {"tests": [MEAN_TESTS] * count, "entry_point": ["mean"] * count},
        errors=reraise,
    )  # fmt: skip
    assert total.tolist() == [1.0] + [0.0] * len(HOSTILE_OUTPUTS) + [1.0]
    logged = caplog.text
    assert "sample 1 " in logged and "sample 2 " in logged and "could not be read" in logged
    assert "sample 0 " not in logged and f"sample {count - 1} " not in logged


@needs_sandbox
def test_an_error_while_scoring_one_sample_scores_only_that_one_zero(reward, monkeypatch, caplog):
    real_run = reward.sandbox.run

    def run_failing_for_one(files, entry, stdin=""):
        if "BREAKS_THE_SCORER" in files["solution.py"]:
            raise RuntimeError("something no one foresaw")
        return real_run(files, entry, stdin)

    monkeypatch.setattr(reward.sandbox, "run", run_failing_for_one)
    programs = ["def add(a, b):\n    return a + b", "# BREAKS_THE_SCORER", "def add(a, b):\n    return a + b"]
    with caplog.at_level("WARNING", logger="gspo_lightning.rewards.code"):
        assert reward(["p"] * 3, programs, tests=[ADD_TESTS] * 3, entry_point=["add"] * 3) == [1.0, 0.0, 1.0]
    assert "CodeTests: sample 1 scored 0: RuntimeError: something no one foresaw" in caplog.text


@needs_sandbox
def test_stdio_programs_printing_garbage_score_zero_next_to_honest_ones(reward):
    tests = json.dumps([{"stdin": "2 3\n", "stdout": "5\n"}])
    garbage = "import os\nos.write(1, bytes(range(256)) * 4000)"
    programs = ["print(9 ** 6000)", garbage, "print(sum(map(int, input().split())))"]
    assert reward(["p"] * 3, programs, tests=[tests] * 3, entry_point=[""] * 3) == [0.0, 0.0, 1.0]


@needs_sandbox
@pytest.mark.skipif(cgroup_unavailable_reason() is not None, reason=f"no per-run cgroup: {cgroup_unavailable_reason()}")
def test_a_run_killed_at_its_memory_cap_is_logged_with_the_reason(caplog):
    reward = CodeTests(wall_time_s=10.0, memory_mb=128, max_workers=1)
    children = (
        "import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n        b = bytearray(100 * 2**20)\n"
        "        time.sleep(1)\n        os._exit(0)\nfor _ in range(4):\n    os.wait()\n"
        "def add(a, b):\n    return a + b"
    )
    with caplog.at_level("INFO", logger="gspo_lightning.rewards.code"):
        reward(["p"], [children], tests=[ADD_TESTS], entry_point=["add"])
    assert "sample 0" in caplog.text and "memory cap (128 MiB)" in caplog.text

"""CodeTests: programs are scored by the fraction of unit tests they pass, in the sandbox, in parallel."""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path

import pytest

from gspo_lightning.rewards.code import CodeTests, count_call_passes, extract_code, outputs_match, parse_tests
from gspo_lightning.sandbox import isolation_unavailable_reason

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


HOSTILE = {
    "infinite_loop": "def add(a, b):\n    while True:\n        pass",
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "memory_bomb": "x = bytearray(8 * 2**30)\ndef add(a, b):\n    return a + b",
    "write_outside": "open('/tmp/gspo-code-escape', 'w').write('x')\ndef add(a, b):\n    return a + b",
    "socket": "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)\ndef add(a, b):\n    return a + b",
    "kill_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(-1, signal.SIGKILL)",
}


@needs_sandbox
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_programs_score_zero_and_the_trainer_keeps_running(reward, name):
    assert score(reward, HOSTILE[name]) == 0.0
    assert not Path("/tmp/gspo-code-escape").exists()
    assert score(reward, "def add(a, b):\n    return a + b") == 1.0  # and the next batch is scored as usual


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

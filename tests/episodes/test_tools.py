import os
import threading
import time

import pytest

from gspo_lightning.episodes import RunPython, Tool, calculator
from gspo_lightning.episodes.tools import ToolTimeoutError, call_with_time_limit, result_text, tools_by_name
from tests.sandbox.conftest import needs_isolation


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def test_a_functions_schema_comes_from_its_signature_and_docstring():
    tool = Tool.of(add)
    assert tool.name == "add"
    function = tool.schema["function"]
    assert function["description"] == "Add two integers."
    assert function["parameters"]["properties"] == {"a": {"type": "integer", "description": "the first."},
                                                    "b": {"type": "integer", "description": "the second."}}  # fmt: skip
    assert function["parameters"]["required"] == ["a"]


def test_a_callable_object_is_named_by_its_name_attribute():
    class Lookup:
        name = "lookup"

        def __call__(self, key: str) -> str:
            """Look a key up.

            Args:
                key: what to look up.
            """
            return key.upper()

    tool = Tool.of(Lookup())
    assert tool.name == "lookup" and tool.schema["function"]["name"] == "lookup"
    assert list(tool.schema["function"]["parameters"]["properties"]) == ["key"]


def test_a_tool_without_type_hints_is_refused_naming_it():
    def bare(x):
        """Nothing.

        Args:
            x: something.
        """

    with pytest.raises(ValueError, match="tool .*bare: its JSON schema cannot be built"):
        Tool.of(bare)


def test_two_tools_of_one_name_are_refused():
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        tools_by_name([add, add])


@pytest.mark.parametrize(
    ("expression", "result"),
    [("123*456", "56088"), ("(1+2)*3-4", "5"), ("7/2", "3.5"), ("8/2", "4"), ("-3+1", "-2"), ("17//5", "3"),
     ("1/0", "error: division by zero"), ("__import__('os')", "error: only numbers"), ("2**8", "error: only numbers"),
     ("1+", "error: '1+' is not an arithmetic expression"), ("9" * 101 + "*1", "error: numbers are limited")],
)  # fmt: skip
def test_the_calculator_is_exact_and_evaluates_arithmetic_only(expression, result):
    assert calculator(expression).startswith(result)


def test_a_call_over_its_time_limit_is_abandoned():
    release = threading.Event()

    def slow() -> str:
        """Wait.
        """
        release.wait(5)
        return "late"

    started = time.monotonic()
    with pytest.raises(ToolTimeoutError, match="did not return within 0.2 s"):
        call_with_time_limit(Tool("slow", slow, {}), {}, 0.2)
    assert time.monotonic() - started < 2
    release.set()
    assert call_with_time_limit(Tool("slow", slow, {}), {}, 5) == "late"


def test_results_reach_the_model_as_text():
    assert result_text("x") == "x"
    assert result_text({"a": [1, 2]}) == '{"a": [1, 2]}'
    assert result_text(3) == "3"
    assert result_text(object()).startswith("<object")


def test_run_python_settings_are_validated():
    with pytest.raises(ValueError, match="RunPython.wall_time_s must be a positive number"):
        RunPython(wall_time_s=0, isolation="off")
    with pytest.raises(ValueError, match="RunPython.output_chars must be an integer >= 1"):
        RunPython(output_chars=0, isolation="off")


@needs_isolation
def test_run_python_returns_what_the_program_printed():
    run = RunPython()
    assert Tool.of(run).name == "run_python"
    assert run("print(6 * 7)") == "42"
    assert "ZeroDivisionError" in run("print(1 / 0)") and "exit status 1" in run("print(1 / 0)")
    assert run("print('x' * 5000)").endswith("...(cut)")


@needs_isolation
def test_run_python_contains_a_hostile_program(tmp_path):
    secret = tmp_path / "credentials"
    secret.write_text("token-123")
    run = RunPython(wall_time_s=2.0)
    hostile = f"""
import os, socket
found = []
try:
    found.append(open({str(secret)!r}).read())
except OSError as error:
    found.append("no file")
try:
    socket.create_connection(("1.1.1.1", 53), timeout=1)
    found.append("network")
except OSError:
    found.append("no network")
try:
    os.kill(1, 9)
    found.append("killed init")
except OSError:
    found.append("no kill")
print(" ".join(found))
"""
    assert run(hostile) == "no file no network no kill"
    assert "timed out after 2.0 s" in run("while True:\n    pass")
    assert os.path.exists(secret) and secret.read_text() == "token-123"

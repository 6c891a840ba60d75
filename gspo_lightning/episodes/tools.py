"""Tools: plain Python functions with type hints and a docstring, as Hugging Face chat templates take them.

A tool's JSON schema comes from its signature and docstring (``transformers.utils.get_json_schema``) and reaches
the model through the tokenizer's chat template (``apply_chat_template(..., tools=schemas)``). A call runs in a
daemon thread with a time limit: Python cannot stop a thread, so a call that overruns is abandoned (it runs on
until it returns) and counts as failed. Tools that run model-written code must not run in the trainer's
process: ``RunPython`` runs it in the project's sandbox.
"""

from __future__ import annotations

import ast
import json
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers.utils import get_json_schema

from gspo_lightning.rewards.isolation import in_daemon_thread
from gspo_lightning.sandbox import Isolation, Sandbox, SandboxLimits
from gspo_lightning.sandbox.spec import limits_problem


class ToolTimeoutError(TimeoutError):
    """A tool did not return within its time limit."""


@dataclass(frozen=True)
class Tool:
    """A callable the model may call by ``name``; ``schema`` is what the chat template shows the model."""

    name: str
    function: Callable[..., Any]
    schema: dict[str, Any]

    @classmethod
    def of(cls, function: Callable[..., Any] | Tool) -> Tool:
        """A tool from a function (or a callable object: its ``name`` attribute, else its class's name, names it;
        its ``__call__``'s signature and docstring make the schema); a ``Tool`` as it is."""
        if isinstance(function, Tool):
            return function
        target = function if _is_plain_function(function) else getattr(function, "__call__")  # noqa: B004
        try:
            schema = get_json_schema(target)
        except Exception as error:  # transformers' DocstringParsingException / TypeHintParsingException
            raise ValueError(
                f"tool {_describe(function)}: its JSON schema cannot be built from its signature and docstring "
                f"({error}); a tool needs a type hint on every argument and a Google-style docstring with an "
                "Args: section"
            ) from error
        name = schema["function"]["name"]
        if not _is_plain_function(function):
            name = getattr(function, "name", None) or type(function).__name__
            schema = {**schema, "function": {**schema["function"], "name": name}}
        return cls(name, function, schema)


def _is_plain_function(function: Any) -> bool:
    return callable(function) and hasattr(function, "__code__")


def _describe(function: Any) -> str:
    return getattr(function, "__qualname__", None) or type(function).__name__


def tools_by_name(functions: list[Callable[..., Any] | Tool]) -> dict[str, Tool]:
    """Each function as a ``Tool``, by name; two tools of one name are an error."""
    tools: dict[str, Tool] = {}
    for function in functions:
        tool = Tool.of(function)
        if tool.name in tools:
            raise ValueError(f"two tools are named {tool.name!r}: tool names must be unique")
        tools[tool.name] = tool
    return tools


def call_with_time_limit(tool: Tool, arguments: dict[str, Any], timeout_s: float | None) -> Any:
    """``tool.function(**arguments)`` in a daemon thread, waiting at most ``timeout_s`` (None: no limit)."""
    if timeout_s is None:
        return tool.function(**arguments)
    late = ToolTimeoutError(f"did not return within {timeout_s} s (its thread was abandoned)")
    return in_daemon_thread(lambda: tool.function(**arguments), timeout_s, f"gspo-tool-{tool.name}", late)


def result_text(value: Any) -> str:
    """What the model reads back: a string as is, anything else as JSON (``str`` when it is not JSON)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


# ----- built-in tools -----

_OPERATORS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos,
}  # fmt: skip
_MAX_DIGITS = 100  # an expression like 9**9**9 must not stall the trainer: operands and results are bounded


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: numbers, + - * / // % and parentheses, e.g. "123*(45+6)".
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        return f"error: {expression!r} is not an arithmetic expression"
    try:
        value = _evaluate(tree.body)
    except ZeroDivisionError:
        return "error: division by zero"
    except ValueError as error:
        return f"error: {error}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    """An arithmetic AST's value: numbers and the operators above only (no names, calls or powers)."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = node.value
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        value = _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        value = _OPERATORS[type(node.op)](_evaluate(node.operand))
    else:
        raise ValueError("only numbers, + - * / // % and parentheses are allowed")
    if isinstance(value, int) and abs(value) >= 10**_MAX_DIGITS:
        raise ValueError(f"numbers are limited to {_MAX_DIGITS} digits")
    return value


class RunPython:
    """A ``run_python(code)`` tool: the model's program runs in the project's sandbox (``gspo_lightning.sandbox``:
    own namespaces, minimal read-only root, no network, time / memory / process / disk caps) and the tool returns
    what it printed, its error output and its exit status.

    Args:
        isolation: ``required`` (default: refuse to run without every containment step), ``best_effort`` or
            ``off`` (trusted code only).
        wall_time_s: wall-clock seconds per run.
        cpu_time_s: CPU seconds per process of a run.
        memory_mb: memory of a whole run, in MiB.
        output_chars: the longest output the model reads back (the rest is cut, marked).
    """

    name = "run_python"

    def __init__(
        self,
        isolation: Isolation = "required",
        wall_time_s: float = 5.0,
        cpu_time_s: int = 5,
        memory_mb: int = 256,
        output_chars: int = 2000,
    ) -> None:
        problem = limits_problem({"wall_time_s": wall_time_s, "cpu_time_s": cpu_time_s, "memory_mb": memory_mb})
        if problem is not None:
            raise ValueError(f"RunPython.{problem}")
        if not isinstance(output_chars, int) or output_chars < 1:
            raise ValueError(f"RunPython.output_chars must be an integer >= 1, got {output_chars!r}")
        self.output_chars = output_chars
        self.sandbox = Sandbox(SandboxLimits(wall_time_s=wall_time_s, cpu_time_s=cpu_time_s, memory_mb=memory_mb),
                               isolation)  # fmt: skip
        self.sandbox.check()  # fail at configuration time, not in the middle of a rollout

    def __call__(self, code: str) -> str:
        """Run a Python program and return what it printed.

        Args:
            code: the complete program; print what you want to see.
        """
        result = self.sandbox.run({"main.py": code}, "main.py")
        if result.error is not None:
            return f"error: the program could not run ({result.error})"
        parts = [result.stdout.rstrip("\n")]
        if result.stderr.strip():
            parts.append("stderr:\n" + result.stderr.rstrip("\n"))
        if result.timed_out:
            parts.append(f"timed out after {self.sandbox.limits.wall_time_s} s")
        elif result.exit_code != 0:
            parts.append(f"exit status {result.exit_code}")
        text = "\n".join(part for part in parts if part)
        return text if len(text) <= self.output_chars else text[: self.output_chars] + "\n...(cut)"

"""Reading the tool calls out of a policy turn: a small pluggable part (``ToolCallParser``).

The default, ``HermesToolCallParser``, reads the format Qwen2.5 / Qwen3 and the Hermes models are trained on:
each call is a JSON object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``.
A call that cannot be read is not dropped: it becomes a ``ToolCall`` with ``error`` set, which the environment
answers with an error message (the model learns from it) and counts.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from abc import ABC, abstractmethod
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One tool call as the model wrote it.

    Attributes:
        name: the tool's name ("" when it could not be read).
        arguments: the call's keyword arguments.
        text: the call's raw text, for error messages and logs.
        error: why the call cannot be executed (malformed JSON, no name, arguments not an object), else None.
    """

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    text: str = ""
    error: str | None = None


class ToolCallParser(ABC):
    """Reads the tool calls of one policy turn; subclass it for another format (``class_path`` in the config)."""

    @abstractmethod
    def parse(self, turn: str) -> list[ToolCall]:
        """The tool calls in ``turn``, in order; [] when the model answers without one."""


class HermesToolCallParser(ToolCallParser):
    """``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, any number per turn (Qwen3, Hermes).

    An opening tag without its closing one (the turn was cut, or the model forgot it) is a malformed call.

    Args:
        start: the opening tag.
        end: the closing tag.
    """

    def __init__(self, start: str = "<tool_call>", end: str = "</tool_call>") -> None:
        if not start or not end:
            raise ValueError("HermesToolCallParser: start and end tags must be non-empty")
        self.start, self.end = start, end
        self._pattern = re.compile(re.escape(start) + r"(.*?)(?:" + re.escape(end) + r"|$)", re.DOTALL)

    def parse(self, turn: str) -> list[ToolCall]:
        calls = []
        for match in self._pattern.finditer(turn):
            closed = match.group(0).endswith(self.end)
            calls.append(parse_call_json(match.group(1), closed, self.end))
        return calls


def parse_call_json(body: str, closed: bool = True, end_tag: str = "</tool_call>") -> ToolCall:
    """One call's JSON body as a ``ToolCall`` (``error`` set when it is not a valid call)."""
    text = body.strip()
    if not closed:
        return ToolCall("", {}, text, f"the tool call is not closed with {end_tag}")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        return ToolCall("", {}, text, f"the tool call is not valid JSON ({error.msg} at character {error.pos})")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return ToolCall("", {}, text, 'a tool call must be a JSON object with a "name" string')
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(value["name"], {}, text, '"arguments" must be a JSON object')
    return ToolCall(value["name"], arguments, text)


PARSERS = {"hermes": HermesToolCallParser}


def resolve_parser(parser: ToolCallParser | str, setting: str = "sampler.episodes.tool_parser") -> ToolCallParser:
    """A parser instance: ``parser`` itself, or the named one."""
    if isinstance(parser, str):
        if parser not in PARSERS:
            raise ValueError(f"{setting} must be one of {sorted(PARSERS)} or a ToolCallParser, got {parser!r}")
        return PARSERS[parser]()
    if not isinstance(parser, ToolCallParser):
        raise ValueError(f"{setting} must be one of {sorted(PARSERS)} or a ToolCallParser, got {type(parser).__name__}")
    return parser

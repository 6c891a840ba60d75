"""Environments: what answers the policy between its turns (gym-style ``reset`` / ``step``).

One instance per episode, built by a factory (the config's ``class_path`` + ``init_args``). ``reset(row)`` gives
the episode's first messages; ``step(turn)`` reads one policy turn (its text) and answers with the messages the
model sees next (or None), a reward and whether the episode is over. ``ToolEnvironment`` is the tool-calling
loop written as one: it parses the turn's tool calls, runs them and answers with ``tool`` messages, and the
episode ends when the model answers without a call.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gspo_lightning.episodes.parsers import ToolCall, ToolCallParser, resolve_parser
from gspo_lightning.episodes.tools import Tool, call_with_time_limit, result_text, tools_by_name

Message = dict[str, Any]
"""A chat message: ``{"role": ..., "content": ...}`` (a ``tool`` message also has a ``name``)."""


@dataclass(frozen=True)
class Step:
    """An environment's answer to one policy turn.

    Attributes:
        observation: the messages the model sees before its next turn (None or [] when there are none; an
            episode that is not done needs some).
        reward: this turn's reward (an episode's environment reward is the sum over its turns).
        done: the episode is over (the observation, if any, is not shown).
        tool_calls: tool calls made in this turn (for the metrics).
        tool_errors: of them, the malformed ones, those naming an unknown tool or wrong arguments.
    """

    observation: list[Message] | None = None
    reward: float = 0.0
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0


class Environment(ABC):
    """One episode's counterpart. Subclass it, and name it in ``sampler.episodes.environment``.

    ``tools`` (JSON schemas) are shown to the model through the chat template. Randomness should come from the
    ``row`` or from Python's ``random`` / NumPy / torch global generators, which the sampler seeds and saves
    with every checkpoint (an exact resume replays them).
    """

    tools: list[dict[str, Any]] = []

    @abstractmethod
    def reset(self, row: dict[str, Any]) -> list[Message]:
        """The episode's first messages. ``row`` holds the data set row's columns and, under ``"prompt"``, the
        prompt the data module formatted (a string or chat messages)."""

    @abstractmethod
    def step(self, turn: str) -> Step:
        """Answer one policy turn (its text, special tokens left out)."""


EnvironmentFactory = Callable[[], Environment]


def prompt_messages(prompt: Any) -> list[Message]:
    """The data module's prompt as chat messages: a string becomes one user message."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(message) for message in prompt]


class ToolError(RuntimeError):
    """A tool raised or ran out of time (a tool's failure, not the model's): handled like a reward error.

    ``tool`` is the tool, ``position`` its place among the environment's tools (``sampler.episodes.tools[i]``)
    and ``call`` the call's text; the ``__cause__`` is what it raised (or ``ToolTimeoutError``)."""

    def __init__(self, message: str, tool: Tool | None = None, position: int = 0, call: str = "") -> None:
        super().__init__(message)
        self.tool, self.position, self.call = tool, position, call


class ToolEnvironment(Environment):
    """The tool-calling loop: the prompt as the first messages; each turn's tool calls run and their results come
    back as ``tool`` messages; the episode ends when the model answers without a tool call (reward 0 from the
    environment: score the answer with ``sampler.rewards``).

    A malformed call, an unknown tool or arguments the tool does not take are the model's mistakes: the error is
    the tool's result (the model can read it and retry), counted in ``tool_errors``. A tool that raises or
    overruns ``timeout_s`` is the tool's failure: ``ToolError``, which ``sampler.reward_errors`` handles.

    Args:
        tools: the functions (or callable objects) the model may call.
        parser: how calls are read from a turn: ``hermes`` or a ``ToolCallParser``.
        timeout_s: seconds one call may take (None: no limit).
    """

    def __init__(
        self,
        tools: list[Callable[..., Any] | Tool],
        parser: ToolCallParser | str = "hermes",
        timeout_s: float | None = 10.0,
    ) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"sampler.episodes.tool_timeout_s must be > 0 or null, got {timeout_s!r}")
        self.by_name: dict[str, Tool] = tools_by_name(list(tools))
        self.tools = [tool.schema for tool in self.by_name.values()]
        self.parser = resolve_parser(parser)
        self.timeout_s = timeout_s

    def reset(self, row: dict[str, Any]) -> list[Message]:
        return prompt_messages(row["prompt"])

    def step(self, turn: str) -> Step:
        calls = self.parser.parse(turn)
        if not calls:
            return Step(done=True)
        messages, errors = [], 0
        for call in calls:
            text, failed = self.answer(call)
            errors += failed
            messages.append({"role": "tool", "name": call.name, "content": text})
        return Step(observation=messages, tool_calls=len(calls), tool_errors=errors)

    def answer(self, call: ToolCall) -> tuple[str, bool]:
        """The text a call gets back, and whether it was the model's mistake."""
        if call.error is not None:
            return f"error: {call.error}", True
        tool = self.by_name.get(call.name)
        if tool is None:
            return f"error: unknown tool {call.name!r}; the tools are {sorted(self.by_name)}", True
        try:
            inspect.signature(tool.function).bind(**call.arguments)
        except TypeError as error:
            return f"error: {call.name}: {error}", True
        try:
            value = call_with_time_limit(tool, call.arguments, self.timeout_s)
        except Exception as error:
            raise ToolError(
                f"tool {call.name!r} failed on the call {call.text!r}: {type(error).__name__}: {error}",
                tool, list(self.by_name).index(call.name), call.text,
            ) from error
        return result_text(value), False

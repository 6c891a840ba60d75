"""``sampler.episodes``: multi-turn rollouts with tools or an environment, and their limits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gspo_lightning.episodes.environment import Environment, EnvironmentFactory, ToolEnvironment
from gspo_lightning.episodes.loop import EpisodeCodeError
from gspo_lightning.episodes.parsers import ToolCallParser, resolve_parser
from gspo_lightning.episodes.tools import tools_by_name
from gspo_lightning.validation import SettingError, qualified_name


@dataclass
class EpisodeSettings:
    """Each of the P x G samples is an episode of up to ``max_turns`` policy turns instead of one response.

    Give either ``tools`` (the tool-calling loop, ``ToolEnvironment``) or ``environment`` (your own
    ``Environment``). A turn is at most ``model.max_new_tokens`` tokens. Every limit an episode hits marks it
    truncated (``sampler.mask_truncated`` then leaves it out of the loss); a failing tool or environment is
    handled as ``sampler.reward_errors`` says (``raise``: stop, naming it, the call and the episode; ``skip``:
    the episode's group is left out of learning).

    Args:
        tools: functions (import paths) or callable objects (``class_path``) the model may call, each with type
            hints and a docstring (its JSON schema reaches the model through the chat template).
        environment: an ``Environment`` subclass (``class_path`` and ``init_args``); one instance per episode.
        tool_parser: how tool calls are read from a turn: ``hermes`` (``<tool_call>{json}</tool_call>``,
            Qwen3) or a ``ToolCallParser`` (``class_path``).
        tool_timeout_s: seconds one tool call may take (null: no limit).
        max_turns: policy turns per episode at most (>= 1).
        max_episode_tokens: tokens of a whole episode at most, prompt included (null: the policy's context
            length); the last turn is cut to fit.
        turn_advantages: per-turn advantages: each turn's tokens get the group-normalised return from that
            turn on (needs an objective with per-token advantages: ``gspo_token``, ``grpo``, ...); the same as
            the episode's advantage when all reward comes at the end.
    """

    tools: list[Callable[..., Any]] = field(default_factory=list)
    environment: Callable[[], Environment] | None = None
    tool_parser: ToolCallParser | str = "hermes"
    tool_timeout_s: float | None = 10.0
    max_turns: int = 4
    max_episode_tokens: int | None = None
    turn_advantages: bool = False

    def __post_init__(self) -> None:
        if bool(self.tools) == (self.environment is not None):
            raise SettingError(
                "sampler.episodes needs exactly one of tools (the tool-calling loop) or environment (an Environment "
                f"class_path); got {'both' if self.tools else 'neither'}"
            )
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise SettingError(f"sampler.episodes.max_turns must be an integer >= 1, got {self.max_turns!r}")
        budget = self.max_episode_tokens
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 2):
            raise SettingError(
                f"sampler.episodes.max_episode_tokens must be an integer >= 2 or null (the context), got {budget!r}"
            )
        if self.tool_timeout_s is not None and not self.tool_timeout_s > 0:
            raise SettingError(f"sampler.episodes.tool_timeout_s must be > 0 or null, got {self.tool_timeout_s!r}")
        try:
            self.tool_parser = resolve_parser(self.tool_parser)
        except ValueError as error:
            raise SettingError(str(error)) from None
        self._factory = self._build_factory()  # a tool without type hints fails here, not mid-rollout

    def factory(self) -> EnvironmentFactory:
        """What builds one episode's environment."""
        return self._factory

    def _build_factory(self) -> EnvironmentFactory:
        if self.environment is not None:
            return _named_failures(self.environment)
        try:
            tools = list(tools_by_name(list(self.tools)).values())  # the schemas, built once for every episode
        except ValueError as error:
            raise SettingError(f"sampler.episodes.tools: {error}") from None
        parser, timeout = self.tool_parser, self.tool_timeout_s
        return lambda: ToolEnvironment(tools, parser, timeout)

    def episode_budget(self, context: int | None) -> int | None:
        """Tokens one episode may hold: ``max_episode_tokens`` within the policy's context."""
        if self.max_episode_tokens is None:
            return context
        if context is not None and self.max_episode_tokens > context:
            raise SettingError(
                f"sampler.episodes.max_episode_tokens={self.max_episode_tokens} exceeds the policy's context length "
                f"{context}: lower it (or null for the context)"
            )
        return self.max_episode_tokens


def _named_failures(factory: Callable[[], Environment]) -> EnvironmentFactory:
    """``factory``, whose errors (the environment's ``__init__`` raised) name ``sampler.episodes.environment``."""
    built = next((a for a in getattr(factory, "args", ()) if isinstance(a, type)), factory)  # jsonargparse's partial
    name = qualified_name(built)

    def environment() -> Environment:
        try:
            return factory()
        except Exception as error:
            message = f"building the environment {name} failed: {type(error).__name__}: {error}"
            raise EpisodeCodeError(message, "sampler.episodes.environment", name, error) from error

    return environment

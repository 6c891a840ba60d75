"""Calling user reward functions and combining them, with clear errors when one misbehaves."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from numbers import Real
from typing import Any

import torch
from torch import Tensor

RewardFunction = Callable[..., list[float]]
"""``fn(prompts, completions, **columns) -> list[float]``: one score per completion."""


def reward_name(fn: RewardFunction) -> str:
    """A short, stable name for logging: the function's or the class's name."""
    return getattr(fn, "__name__", None) or type(fn).__name__


def _checked_scores(fn: RewardFunction, values: Any, expected: int, completions: list[str]) -> list[float]:
    name = reward_name(fn)
    if not isinstance(values, Sequence) or isinstance(values, str | bytes):
        raise TypeError(f"reward function {name} must return a list of floats, got {type(values).__name__}")
    if len(values) != expected:
        raise ValueError(f"reward function {name} returned {len(values)} values for {expected} completions")
    for value, completion in zip(values, completions):
        if isinstance(value, bool) or not isinstance(value, Real):
            raise TypeError(f"reward function {name} returned a non-number {value!r} for {completion!r}")
        if not math.isfinite(float(value)):
            raise ValueError(f"reward function {name} returned {value} for completion {completion!r}")
    return [float(v) for v in values]


def score_completions(
    reward_fns: Sequence[RewardFunction],
    weights: Sequence[float],
    prompts: list[Any],
    completions: list[str],
    columns: dict[str, list[Any]],
) -> tuple[Tensor, dict[str, Tensor]]:
    """Weighted sum of every reward function's scores.

    Returns:
        total: [N] float32 combined reward.
        components: each function's unweighted scores [N], keyed by ``reward_name`` (for logging).
    """
    total = torch.zeros(len(completions), dtype=torch.float32)  # [N]
    components: dict[str, Tensor] = {}
    for fn, weight in zip(reward_fns, weights, strict=True):
        name = reward_name(fn)
        try:
            values = fn(prompts, completions, **columns)
        except Exception as error:
            raise RuntimeError(
                f"reward function {name} raised {type(error).__name__}: {error} "
                f"(first completion: {completions[0]!r}, prompt: {prompts[0]!r})"
            ) from error
        scores = torch.tensor(_checked_scores(fn, values, len(completions), completions))  # [N]
        components[name] = scores
        total += weight * scores
    return total, components

"""Calling user reward functions and combining them, with clear errors when one misbehaves.

A reward function misbehaves when it raises, times out, kills its worker, returns something that is not a list
of the right length, or returns a non-number, NaN or inf for a sample. With ``errors="raise"`` the first such
problem stops the run with an error naming the function, what went wrong and the first offending sample. With
``errors="skip"`` the affected samples get a NaN score instead (a failed call affects every sample, a bad value
only its own) and a warning is logged; the caller decides what NaN means (the sampler drops those groups from
the learning signal). A function or input that cannot be pickled for a worker process always raises: that is a
configuration mistake, not a sample's fault.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Any, Literal

import torch
from torch import Tensor

from gspo_lightning.rewards.isolation import (
    RewardNotPicklableError,
    RewardRunner,
    RewardTimeoutError,
    RewardWorkerCrashedError,
)
from gspo_lightning.validation import UserCodeError, qualified_name

RewardFunction = Callable[..., list[float]]
"""``fn(prompts, completions, **columns) -> list[float]``: one score per completion."""

RewardErrors = Literal["raise", "skip"]
REWARD_ERRORS: tuple[str, ...] = ("raise", "skip")

logger = logging.getLogger(__name__)

_SHOWN_CHARACTERS = 300


class RewardFunctionError(UserCodeError):
    """A reward function raised (``sampler.reward_errors: raise``): the command line names the setting
    (``sampler.rewards[i]``, ``evaluation.correct``), the function and its error, and shows the function's own
    frames."""


def reward_name(fn: RewardFunction) -> str:
    """A short, stable name for logging: the function's or the class's name."""
    return getattr(fn, "__name__", None) or type(fn).__name__


@dataclass(frozen=True)
class _Problem:
    """What went wrong with one reward call, and which samples (rows) it affects; ``rows[0]`` is named."""

    error_type: type[Exception]
    what: str
    rows: list[int]
    cause: BaseException | None = None


def _call(
    fn: RewardFunction, runner: RewardRunner | None, prompts: list[Any], completions: list[str], columns: dict
) -> tuple[Any, _Problem | None]:
    every_row = list(range(len(completions)))
    try:
        if runner is None:
            values = fn(prompts, completions, **columns)
        else:
            values = runner(fn, prompts, completions, columns)
    except RewardNotPicklableError as error:
        raise RewardNotPicklableError(f"reward function {reward_name(fn)}: {error}") from error
    except (RewardTimeoutError, RewardWorkerCrashedError) as error:
        return None, _Problem(type(error), str(error), every_row, error)
    except Exception as error:
        return None, _Problem(RuntimeError, f"raised {type(error).__name__}: {error}", every_row, error)
    return values, None


def _value_problems(values: Any, expected: int) -> list[_Problem]:
    """Problems with what a reward function returned: the whole list, or single values."""
    every_row = list(range(expected))
    if not isinstance(values, Sequence) or isinstance(values, str | bytes):
        return [_Problem(TypeError, f"must return a list of floats, got {type(values).__name__}", every_row)]
    if len(values) != expected:
        return [_Problem(ValueError, f"returned {len(values)} values for {expected} completions", every_row)]
    problems = []
    for row, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, Real):
            problems.append(_Problem(TypeError, f"returned a non-number {value!r}", [row]))
        elif not math.isfinite(float(value)):
            problems.append(_Problem(ValueError, f"returned {value}", [row]))
    return problems


def _clip(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARACTERS else text[:_SHOWN_CHARACTERS] + "...(cut)"


def _describe(name: str, problem: _Problem, prompts: list[Any], completions: list[str]) -> str:
    row = problem.rows[0]
    return (
        f"reward function {name} {problem.what} (first offending sample {row}: completion "
        f"{_clip(completions[row])}, prompt {_clip(prompts[row])})"
    )


def _scores(
    fn: RewardFunction,
    runner: RewardRunner | None,
    errors: RewardErrors,
    prompts: list[Any],
    completions: list[str],
    columns: dict[str, list[Any]],
    setting: str = "sampler.rewards[0]",
) -> Tensor:
    """One function's float32 scores [N], NaN where unavailable (``errors="skip"``); ``setting`` names it."""
    values, failed_call = _call(fn, runner, prompts, completions, columns)
    problems = [failed_call] if failed_call else _value_problems(values, len(completions))
    if problems and errors == "raise":
        first = problems[0]
        message = _describe(reward_name(fn), first, prompts, completions)
        if failed_call is not None and first.error_type is RuntimeError and first.cause is not None:  # fn raised
            detail = (
                f"called on {len(completions)} completion(s), the first {_clip(completions[0])} "
                f"(prompt {_clip(prompts[0])})" if completions else ""
            )
            raise RewardFunctionError(message, setting, qualified_name(fn), first.cause, detail=detail) from first.cause
        raise first.error_type(message) from first.cause
    if failed_call or (problems and len(problems[0].rows) == len(completions)):
        scores = torch.full((len(completions),), math.nan)  # [N]
    else:
        scores = torch.tensor([float(v) if isinstance(v, Real) else math.nan for v in values])  # [N]
    for problem in problems:
        scores[problem.rows] = math.nan
    if problems:
        affected = int(scores.isnan().sum())
        logger.warning(
            "%s; %d sample(s) left out of the learning signal (reward_errors='skip')",
            _describe(reward_name(fn), problems[0], prompts, completions),
            affected,
        )
    return scores.float()


def score_completions(
    reward_fns: Sequence[RewardFunction],
    weights: Sequence[float],
    prompts: list[Any],
    completions: list[str],
    columns: dict[str, list[Any]],
    runner: RewardRunner | None = None,
    errors: RewardErrors = "raise",
    settings: Sequence[str] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Weighted sum of every reward function's scores.

    Args:
        reward_fns: the reward functions, each called once on the whole batch.
        weights: one weight per function.
        prompts, completions, columns: entry i of each belongs to completion i.
        runner: how to call the functions (thread/process isolation, timeout); None calls them directly.
        errors: ``"raise"`` stops at the first misbehaviour; ``"skip"`` gives the affected samples NaN.
        settings: the setting naming each function, for a function that raises (``RewardFunctionError``);
            None: ``sampler.rewards[i]``.

    Returns:
        total: [N] float32 combined reward; NaN where any function's score is unavailable (``"skip"``).
        components: each function's unweighted scores [N], keyed by ``reward_name`` (for logging).
    """
    if errors not in REWARD_ERRORS:
        raise ValueError(f"reward errors must be one of {list(REWARD_ERRORS)}, got {errors!r}")
    total = torch.zeros(len(completions), dtype=torch.float32)  # [N]
    components: dict[str, Tensor] = {}
    if settings is None:
        settings = [f"sampler.rewards[{number}]" for number in range(len(reward_fns))]
    for fn, weight, setting in zip(reward_fns, weights, settings, strict=True):
        scores = _scores(fn, runner, errors, prompts, completions, columns, setting)  # [N]
        components[reward_name(fn)] = scores
        total += weight * scores
    return total, components

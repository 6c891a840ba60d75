"""The objective registry: each objective's module registers what the rest of gspo_lightning needs to know.

Adding an objective is one new module in ``gspo_lightning/objectives/`` that calls :func:`register` at import
(the package imports every module in it): its loss, the level of its ratio (for the diagnostics and the
rollout correction), its default clip range, how its token terms weigh (the KL penalty aggregates alike),
whether its loss is a sum of per-response terms (what the chunked LM head's gradient prediction relies on), the
options it takes, and a loop-by-loop reference implementation that ``tests/objectives/test_registry.py`` checks
the vectorised loss against. Nothing else is edited.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import Tensor

LossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]
"""``(logprobs [N, T], old_logprobs [N, T], advantages [N] or [N, T], mask [N, T], eps_low, eps_high, **options)
-> (loss [], stats {name: detached float32 []})``; stats hold at least ``clip_frac`` (the fraction of response tokens
whose gradient the objective's clip or gate removes or damps)."""

RatioLevel = Literal["sequence", "token"]
Aggregation = Literal["sequence_mean", "token_mean", "constant"]


@dataclass(frozen=True)
class Objective:
    """One registered objective.

    Attributes:
        name: what ``model.objective`` names it by.
        loss: the vectorised loss (see ``LossFn``).
        reference_loss: the same loss written loop by loop over responses and tokens, in float64, for the tests.
        ratio: ``sequence`` (one ratio per response: GSPO's s_i, GMPO's geometric mean) or ``token``.
        aggregation: how its token terms weigh (``sequence_mean``: each response 1/N; ``token_mean``: each token
            1/sum|y|; ``constant``: 1/(N max_tokens)); a KL penalty is aggregated the same way.
        clip_range: the default (eps_low, eps_high), the paper's where a paper gives them.
        clip_bounds: the open intervals eps_low and eps_high must lie in (0 < eps < 1 for ratio clipping).
        separable: the loss is a sum of per-response terms with normalisers fixed by the masks, so one response's
            gradient follows from its own log-probs (the chunked LM head then forms the head's gradients in forward;
            otherwise it recomputes them in backward).
        per_token_advantages: the loss takes advantages [N, T] as well as [N].
        options: the names of the extra settings it takes (``ObjectiveSpec.options``), with their defaults.
        paper: where it comes from, with the equation numbers its docstring cites.
    """

    name: str
    loss: LossFn
    reference_loss: LossFn
    ratio: RatioLevel
    aggregation: Aggregation
    clip_range: tuple[float, float]
    paper: str
    clip_bounds: tuple[tuple[float, float], tuple[float, float]] = ((0.0, 1.0), (0.0, 1.0))
    separable: bool = True
    per_token_advantages: bool = False
    options: dict[str, Any] = field(default_factory=dict)

    def check_clip_range(self, eps_low: float, eps_high: float, prefix: str = "model.") -> None:
        """Raise ValueError unless each eps lies in its open interval of ``clip_bounds``."""
        for setting, value, (low, high) in zip(("eps_low", "eps_high"), (eps_low, eps_high), self.clip_bounds):
            if not low < float(value) < high:
                raise ValueError(
                    f"{prefix}{setting} must be in ({low:g}, {high:g}) for objective {self.name!r}, got {value!r}"
                )


OBJECTIVES: dict[str, Objective] = {}
"""Every registered objective by name (filled as ``gspo_lightning.objectives`` imports its modules)."""


def register(objective: Objective) -> Objective:
    """Add ``objective`` to ``OBJECTIVES`` (a second one with the same name is refused)."""
    if objective.name in OBJECTIVES:
        raise ValueError(f"an objective named {objective.name!r} is already registered")
    if objective.ratio not in ("sequence", "token"):
        raise ValueError(f"objective {objective.name!r}: ratio must be 'sequence' or 'token', got {objective.ratio!r}")
    if objective.aggregation not in ("sequence_mean", "token_mean", "constant"):
        raise ValueError(f"objective {objective.name!r}: unknown aggregation {objective.aggregation!r}")
    low, high = objective.clip_range
    objective.check_clip_range(low, high, prefix=f"{objective.name}'s default ")
    OBJECTIVES[objective.name] = objective
    return objective


def get_objective(name: str) -> Objective:
    """The registered objective ``name``, or a ValueError listing the allowed names."""
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; allowed names: {', '.join(sorted(OBJECTIVES))}")
    return OBJECTIVES[name]

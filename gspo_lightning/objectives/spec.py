"""Which objective to train with: a validated spec over the registry, the presets, and one entry point.

A spec names a registered objective (``registry.OBJECTIVES``: gspo, gspo_token, grpo, dapo, dr_grpo, cispo,
gmpo, sapo, and any added since), its options, and an optional KL penalty to a reference policy. It is
validated once, when it is built; ``objective_loss`` then only computes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from gspo_lightning.objectives.aggregation import aggregate_constant, aggregate_sequence_mean, aggregate_token_mean
from gspo_lightning.objectives.kl import (
    KL_ESTIMATORS,
    KL_PLACEMENTS,
    LOSS_KL_ESTIMATORS,
    KLEstimator,
    KLPlacement,
    KLRewardPenalty,
    kl_penalty,
)
from gspo_lightning.objectives.registry import OBJECTIVES, Objective, get_objective


@dataclass(frozen=True)
class ObjectiveSpec:
    """An objective: a registered name, its options, and a KL penalty. Validated on construction.

    Attributes:
        name: a registered objective (``gspo``, ``gspo_token``, ``grpo``, ``dapo``, ``dr_grpo``, ``cispo``,
            ``gmpo``, ``sapo``, ...).
        kl_coef: weight of the KL penalty to the reference policy; 0 (the paper's choice) is off.
        kl_estimator: ``"k2"`` (its gradient is that of KL(pi_theta || pi_ref)), ``"k3"`` (its gradient is that of
            KL(pi_ref || pi_theta)) or, only with ``kl_in="reward"``, ``"k1"`` (see :mod:`objectives.kl`).
        kl_in: ``"loss"`` adds ``kl_coef`` times the aggregated per-token estimate to the loss; ``"reward"``
            subtracts ``kl_coef`` times each response's summed estimate (pi_old vs pi_ref) from its reward before
            the advantages are computed.
        options: the objective's own settings (``gspo``: ``max_log_ratio``; ``dr_grpo``: ``max_tokens``;
            ``sapo``: ``tau_pos``, ``tau_neg``); the others keep their defaults.
    """

    name: str = "gspo"
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    kl_in: KLPlacement = "loss"
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_spec(self)

    @property
    def objective(self) -> Objective:
        """The registered objective this spec names."""
        return OBJECTIVES[self.name]

    @property
    def ratio(self) -> str:
        """``sequence`` or ``token``: the level of the objective's ratio."""
        return self.objective.ratio

    @property
    def resolved_options(self) -> dict[str, Any]:
        """The objective's options: its defaults, overridden by ``options``."""
        return {**self.objective.options, **self.options}


def validate_spec(spec: ObjectiveSpec) -> None:
    """Raise ValueError for an unknown objective or option, or a KL setting that cannot work."""
    objective = get_objective(spec.name)
    unknown = sorted(set(spec.options) - set(objective.options))
    if unknown:
        allowed = ", ".join(sorted(objective.options)) or "none"
        raise ValueError(f"objective {spec.name!r} has no option(s) {unknown}; its options: {allowed}")
    if not (isinstance(spec.kl_coef, int | float) and math.isfinite(spec.kl_coef) and spec.kl_coef >= 0):
        raise ValueError(f"kl_coef must be a finite number >= 0 (0 turns the penalty off), got {spec.kl_coef!r}")
    if spec.kl_estimator not in KL_ESTIMATORS:
        raise ValueError(
            f"kl_estimator must be one of {', '.join(KL_ESTIMATORS)}, got kl_estimator={spec.kl_estimator!r}"
        )
    if spec.kl_in not in KL_PLACEMENTS:
        raise ValueError(f"kl_in must be one of {', '.join(KL_PLACEMENTS)}, got kl_in={spec.kl_in!r}")
    if spec.kl_in == "loss" and spec.kl_coef > 0 and spec.kl_estimator not in LOSS_KL_ESTIMATORS:
        raise ValueError(
            f"kl_estimator={spec.kl_estimator!r} as a loss term has an expected gradient of 0 on the sampled "
            f"tokens (it adds noise and no pull to the reference); use kl_estimator one of "
            f"{', '.join(LOSS_KL_ESTIMATORS)} (k2's gradient is that of KL(pi_theta || pi_ref), k3's that of "
            f"KL(pi_ref || pi_theta)), or kl_in='reward' to subtract it from the rewards"
        )
    max_tokens = spec.options.get("max_tokens")
    if max_tokens is not None and not (isinstance(max_tokens, int) and max_tokens >= 1):
        raise ValueError(f"max_tokens must be an integer >= 1 (or None for T), got max_tokens={max_tokens!r}")


def objective_presets() -> dict[str, ObjectiveSpec]:
    """Every registered objective as a preset with its defaults, by name."""
    return {name: ObjectiveSpec(name) for name in sorted(OBJECTIVES)}


def reward_kl_penalty(spec: ObjectiveSpec) -> KLRewardPenalty | None:
    """The KL penalty ``spec`` subtracts from the rewards (``kl_in="reward"``), or None."""
    if spec.kl_coef > 0 and spec.kl_in == "reward":
        return KLRewardPenalty(spec.kl_coef, spec.kl_estimator)
    return None


def resolve_objective(name_or_spec: str | ObjectiveSpec) -> ObjectiveSpec:
    """A registered objective's spec by name, or a given spec (validated when it was built)."""
    if isinstance(name_or_spec, ObjectiveSpec):
        return name_or_spec
    if not isinstance(name_or_spec, str):
        raise TypeError(f"expected an objective name or an ObjectiveSpec, got {type(name_or_spec).__name__}")
    return ObjectiveSpec(get_objective(name_or_spec).name)


def _aggregate(values: Tensor, token_mask: Tensor, spec: ObjectiveSpec) -> Tensor:
    """Token values [N, T] -> [] with the objective's own weighting (a KL penalty weighs responses alike)."""
    aggregation = spec.objective.aggregation
    if aggregation == "token_mean":
        return aggregate_token_mean(values, token_mask)
    if aggregation == "constant":
        return aggregate_constant(values, token_mask, spec.resolved_options.get("max_tokens"))
    return aggregate_sequence_mean(values, token_mask)


def objective_loss(
    spec: ObjectiveSpec,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    ref_logprobs: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss ``spec`` names, plus ``kl_coef * KL`` when ``spec.kl_coef > 0`` and ``spec.kl_in == "loss"``;
    returns ``(loss, stats)``.

    The KL estimate (``kl_penalty``, per token) is aggregated the way the objective aggregates its tokens, so the
    penalty weighs responses as the objective does. ``stats["kl"]`` (detached) is reported whenever
    ``ref_logprobs`` is given, even with ``kl_coef == 0`` (then nothing is added to the loss). ``ref_logprobs``
    [N, T] are the reference policy's log-probabilities, required when the penalty is in the loss.
    """
    if spec.kl_coef > 0 and spec.kl_in == "loss" and ref_logprobs is None:
        raise ValueError(f"kl_coef={spec.kl_coef} > 0 needs ref_logprobs (the reference policy's log-probs)")
    loss, stats = spec.objective.loss(
        logprobs, old_logprobs, advantages, mask, eps_low, eps_high, **spec.resolved_options
    )
    if ref_logprobs is None:
        return loss, stats
    kl = _aggregate(kl_penalty(logprobs, ref_logprobs, mask, spec.kl_estimator), mask != 0, spec)  # []
    if spec.kl_coef > 0 and spec.kl_in == "loss":
        loss = loss + spec.kl_coef * kl
    return loss, {**stats, "kl": kl.detach().float()}

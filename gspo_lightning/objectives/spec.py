"""Which objective to train with: a validated spec, named presets and one entry point, ``objective_loss``.

A spec names the importance ratio (sequence: GSPO Eq. 7; token: GRPO Eq. 2; sequence_token: GSPO-token
Eq. 17), how token terms are aggregated (see ``aggregation``) and an optional KL penalty to a reference policy.
Combinations that would silently turn one objective into another are rejected.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Literal

from torch import Tensor

from gspo_lightning.objectives.aggregation import aggregate_constant, aggregate_sequence_mean, aggregate_token_mean
from gspo_lightning.objectives.grpo import dr_grpo_loss, grpo_loss, grpo_token_mean_loss
from gspo_lightning.objectives.gspo import gspo_loss
from gspo_lightning.objectives.gspo_token import gspo_token_loss
from gspo_lightning.objectives.kl import (
    KL_ESTIMATORS,
    KL_PLACEMENTS,
    LOSS_KL_ESTIMATORS,
    KLEstimator,
    KLPlacement,
    KLRewardPenalty,
    kl_penalty,
)

RATIOS: tuple[str, ...] = ("sequence", "token", "sequence_token")
AGGREGATIONS: tuple[str, ...] = ("sequence_mean", "token_mean", "constant")
SEQUENCE_LEVEL_RATIOS: tuple[str, ...] = ("sequence", "sequence_token")

LossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]


@dataclass(frozen=True)
class ObjectiveSpec:
    """An objective: importance ratio, aggregation, KL penalty. Validated on construction (``validate_spec``).

    Attributes:
        ratio: ``"sequence"`` (GSPO's s_i, Eqs. 5, 7), ``"token"`` (GRPO's w_i,t, Eq. 2) or ``"sequence_token"``
            (GSPO-token's s_i,t, Eqs. 13-17, which accepts per-token advantages).
        aggregation: ``"sequence_mean"`` (each response 1/N; Eqs. 2, 5, 13), ``"token_mean"`` (DAPO) or
            ``"constant"`` (Dr. GRPO, sum over ``N * max_tokens``); the last two need ``ratio="token"``.
        kl_coef: weight of the KL penalty to the reference policy; 0 (the paper's choice) is off.
        kl_estimator: ``"k2"`` (its gradient is that of KL(pi_theta || pi_ref)), ``"k3"`` (its gradient is that of
            KL(pi_ref || pi_theta)) or, only with ``kl_in="reward"``, ``"k1"`` (see :mod:`objectives.kl`).
        kl_in: ``"loss"`` adds ``kl_coef`` times the aggregated per-token estimate to the loss; ``"reward"``
            subtracts ``kl_coef`` times each response's summed estimate (pi_old vs pi_ref) from its reward before
            the advantages are computed.
        max_tokens: Dr. GRPO's constant (the generation budget); only with ``aggregation="constant"``, where
            ``None`` means the padded length T of each minibatch.
    """

    ratio: Literal["sequence", "token", "sequence_token"]
    aggregation: Literal["sequence_mean", "token_mean", "constant"] = "sequence_mean"
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    max_tokens: int | None = None
    kl_in: KLPlacement = "loss"

    def __post_init__(self) -> None:
        validate_spec(self)


def validate_spec(spec: ObjectiveSpec) -> None:
    """Raise ValueError for an unknown field value or a combination that silently changes the objective."""
    if spec.ratio not in RATIOS:
        raise ValueError(f"ratio must be one of {', '.join(RATIOS)}, got ratio={spec.ratio!r}")
    if spec.aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got aggregation={spec.aggregation!r}")
    if spec.ratio in SEQUENCE_LEVEL_RATIOS and spec.aggregation != "sequence_mean":
        raise ValueError(
            f"ratio={spec.ratio!r} with aggregation={spec.aggregation!r} re-weights each response by its length "
            f"(|y_i| of its tokens count instead of one response), which silently changes the objective: "
            f"GSPO's Eqs. 5/7 (and GSPO-token's Eq. 13) weigh each response 1/G whatever its length. Use "
            f"aggregation='sequence_mean' with this ratio, or ratio='token' for DAPO's 'token_mean' or "
            f"Dr. GRPO's 'constant' aggregation."
        )
    if not (isinstance(spec.kl_coef, (int, float)) and math.isfinite(spec.kl_coef) and spec.kl_coef >= 0):
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
    if spec.max_tokens is not None and spec.aggregation != "constant":
        raise ValueError(
            f"max_tokens={spec.max_tokens} only applies to aggregation='constant' (Dr. GRPO) and would be "
            f"ignored with aggregation={spec.aggregation!r}; leave it None"
        )
    if spec.max_tokens is not None and not (isinstance(spec.max_tokens, int) and spec.max_tokens >= 1):
        raise ValueError(f"max_tokens must be an integer >= 1 (or None for T), got max_tokens={spec.max_tokens!r}")


OBJECTIVE_PRESETS: dict[str, ObjectiveSpec] = {
    "gspo": ObjectiveSpec(ratio="sequence"),  # Eqs. 5, 7
    "gspo_token": ObjectiveSpec(ratio="sequence_token"),  # Eqs. 13-17
    "grpo": ObjectiveSpec(ratio="token"),  # Eq. 2
    "dapo": ObjectiveSpec(ratio="token", aggregation="token_mean"),  # DAPO's token-level loss
    "dr_grpo": ObjectiveSpec(ratio="token", aggregation="constant"),  # Dr. GRPO; pair with scale="none"
}


def reward_kl_penalty(spec: ObjectiveSpec) -> KLRewardPenalty | None:
    """The KL penalty ``spec`` subtracts from the rewards (``kl_in="reward"``), or None."""
    if spec.kl_coef > 0 and spec.kl_in == "reward":
        return KLRewardPenalty(spec.kl_coef, spec.kl_estimator)
    return None


def resolve_objective(name_or_spec: str | ObjectiveSpec) -> ObjectiveSpec:
    """A preset's spec by name (``OBJECTIVE_PRESETS``), or a given spec after ``validate_spec``."""
    if isinstance(name_or_spec, ObjectiveSpec):
        validate_spec(name_or_spec)
        return name_or_spec
    if not isinstance(name_or_spec, str):
        raise TypeError(f"expected an objective name or an ObjectiveSpec, got {type(name_or_spec).__name__}")
    if name_or_spec not in OBJECTIVE_PRESETS:
        raise ValueError(
            f"unknown objective {name_or_spec!r}; allowed names: {', '.join(sorted(OBJECTIVE_PRESETS))}"
        )
    return OBJECTIVE_PRESETS[name_or_spec]


# (ratio, aggregation) -> the loss, given the spec; validate_spec admits exactly these keys.
_LOSSES: dict[tuple[str, str], Callable[[ObjectiveSpec], LossFn]] = {
    ("sequence", "sequence_mean"): lambda spec: gspo_loss,
    ("sequence_token", "sequence_mean"): lambda spec: gspo_token_loss,
    ("token", "sequence_mean"): lambda spec: grpo_loss,
    ("token", "token_mean"): lambda spec: grpo_token_mean_loss,
    ("token", "constant"): lambda spec: partial(dr_grpo_loss, max_tokens=spec.max_tokens),
}

# aggregation -> (token values [N, T], token mask [N, T], spec) -> [], the same weighting as the objective's.
_AGGREGATORS: dict[str, Callable[[Tensor, Tensor, ObjectiveSpec], Tensor]] = {
    "sequence_mean": lambda values, token_mask, spec: aggregate_sequence_mean(values, token_mask),
    "token_mean": lambda values, token_mask, spec: aggregate_token_mean(values, token_mask),
    "constant": lambda values, token_mask, spec: aggregate_constant(values, token_mask, spec.max_tokens),
}


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

    The KL estimate (``kl_penalty``, per token) is aggregated the way the objective aggregates its tokens
    (sequence_mean: per-response token mean, then mean over valid responses), so the penalty weighs responses
    as the objective does. ``stats["kl"]`` (detached) is reported whenever ``ref_logprobs`` is given, even
    with ``kl_coef == 0`` (then nothing is added to the loss). Arguments are those of the dispatched loss
    (``gspo_loss``, ``gspo_token_loss``, ``grpo_loss``, ``grpo_token_mean_loss``, ``dr_grpo_loss``);
    ``ref_logprobs`` [N, T] are the reference policy's log-probabilities, required when ``kl_coef > 0``.
    """
    validate_spec(spec)
    if spec.kl_coef > 0 and spec.kl_in == "loss" and ref_logprobs is None:
        raise ValueError(f"kl_coef={spec.kl_coef} > 0 needs ref_logprobs (the reference policy's log-probs)")
    loss_fn = _LOSSES[(spec.ratio, spec.aggregation)](spec)
    loss, stats = loss_fn(logprobs, old_logprobs, advantages, mask, eps_low, eps_high)
    if ref_logprobs is None:
        return loss, stats
    token_kl = kl_penalty(logprobs, ref_logprobs, mask, spec.kl_estimator)  # [N, T]
    kl = _AGGREGATORS[spec.aggregation](token_kl, mask != 0, spec)  # []
    if spec.kl_coef > 0 and spec.kl_in == "loss":
        loss = loss + spec.kl_coef * kl
    return loss, {**stats, "kl": kl.detach().float()}

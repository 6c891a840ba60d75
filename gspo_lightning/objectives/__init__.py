"""RL objectives: group advantages (Eq. 6), GSPO (Eqs. 5, 7), GSPO-token (Eqs. 13-17), the GRPO baseline
(Eq. 2) with DAPO's and Dr. GRPO's aggregations, a KL penalty, and ``ObjectiveSpec`` to choose among them."""

from __future__ import annotations

from gspo_lightning.objectives.advantages import ADVANTAGE_SCALES, AdvantageScale, group_advantages
from gspo_lightning.objectives.aggregation import aggregate_constant, aggregate_sequence_mean, aggregate_token_mean
from gspo_lightning.objectives.clipping import MAX_EXP_LOG_RATIO, exp_with_linear_tail
from gspo_lightning.objectives.gradient import objective_gradient
from gspo_lightning.objectives.grpo import dr_grpo_loss, grpo_loss, grpo_token_mean_loss, grpo_token_objective
from gspo_lightning.objectives.gspo import gspo_loss, sequence_log_ratio
from gspo_lightning.objectives.gspo_token import gspo_token_log_ratio, gspo_token_loss, per_token_advantages
from gspo_lightning.objectives.kl import (
    KL_ESTIMATORS,
    KLEstimator,
    KLRewardPenalty,
    k3_from_log_ratio,
    kl_penalty,
    kl_reward_penalty,
)
from gspo_lightning.objectives.rollout_correction import (
    CORRECTION_MODES,
    CorrectedTerms,
    CorrectionMode,
    RolloutCorrection,
    correct_rollout,
    mismatch_stats,
)
from gspo_lightning.objectives.spec import (
    AGGREGATIONS,
    OBJECTIVE_PRESETS,
    RATIOS,
    ObjectiveSpec,
    objective_loss,
    resolve_objective,
    reward_kl_penalty,
    validate_spec,
)

__all__ = [
    "ADVANTAGE_SCALES",
    "CORRECTION_MODES",
    "CorrectedTerms",
    "CorrectionMode",
    "RolloutCorrection",
    "correct_rollout",
    "mismatch_stats",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "MAX_EXP_LOG_RATIO",
    "OBJECTIVE_PRESETS",
    "RATIOS",
    "AdvantageScale",
    "KLEstimator",
    "KLRewardPenalty",
    "ObjectiveSpec",
    "aggregate_constant",
    "aggregate_sequence_mean",
    "aggregate_token_mean",
    "dr_grpo_loss",
    "exp_with_linear_tail",
    "group_advantages",
    "grpo_loss",
    "grpo_token_mean_loss",
    "grpo_token_objective",
    "gspo_loss",
    "gspo_token_log_ratio",
    "gspo_token_loss",
    "k3_from_log_ratio",
    "kl_penalty",
    "kl_reward_penalty",
    "objective_gradient",
    "objective_loss",
    "per_token_advantages",
    "resolve_objective",
    "reward_kl_penalty",
    "sequence_log_ratio",
    "validate_spec",
]

"""RL objectives, pure functions of tensors: group advantages (Eq. 6), the registered objectives (GSPO Eqs. 5, 7;
GSPO-token Eqs. 13-17; GRPO Eq. 2; DAPO; Dr. GRPO; CISPO; GMPO; SAPO), the KL penalty, the rollout-training
mismatch correction, and ``ObjectiveSpec`` to choose among them.

Every module of this package is imported here, so an objective registers itself (``registry.register``) by
being a file in it: adding one touches no other file.
"""

from __future__ import annotations

import importlib
import pkgutil

from gspo_lightning.objectives.advantages import ADVANTAGE_SCALES, AdvantageScale, group_advantages
from gspo_lightning.objectives.aggregation import aggregate_constant, aggregate_sequence_mean, aggregate_token_mean
from gspo_lightning.objectives.clipping import MAX_EXP_LOG_RATIO, exp_with_linear_tail
from gspo_lightning.objectives.kl import (
    KL_ESTIMATORS,
    KLEstimator,
    KLRewardPenalty,
    k3_from_log_ratio,
    kl_penalty,
    kl_reward_penalty,
)
from gspo_lightning.objectives.registry import OBJECTIVES, Objective, get_objective, register

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

from gspo_lightning.objectives.cispo import cispo_loss  # noqa: E402
from gspo_lightning.objectives.dapo import grpo_token_mean_loss  # noqa: E402
from gspo_lightning.objectives.dr_grpo import dr_grpo_loss  # noqa: E402
from gspo_lightning.objectives.gmpo import gmpo_loss  # noqa: E402
from gspo_lightning.objectives.gradient import objective_gradient  # noqa: E402
from gspo_lightning.objectives.grpo import grpo_loss, grpo_token_objective  # noqa: E402
from gspo_lightning.objectives.gspo import gspo_loss, sequence_log_ratio, sequence_ratio  # noqa: E402
from gspo_lightning.objectives.gspo_token import (  # noqa: E402
    gspo_token_log_ratio,
    gspo_token_loss,
    per_token_advantages,
)
from gspo_lightning.objectives.rollout_correction import (  # noqa: E402
    CORRECTION_MODES,
    CorrectedTerms,
    CorrectionMode,
    RolloutCorrection,
    correct_rollout,
    mismatch_stats,
)
from gspo_lightning.objectives.sapo import sapo_loss  # noqa: E402
from gspo_lightning.objectives.spec import (  # noqa: E402
    ObjectiveSpec,
    objective_loss,
    objective_presets,
    resolve_objective,
    reward_kl_penalty,
    validate_spec,
)

OBJECTIVE_PRESETS: dict[str, ObjectiveSpec] = objective_presets()
"""Every registered objective with its defaults, by name."""

__all__ = [
    "ADVANTAGE_SCALES",
    "CORRECTION_MODES",
    "KL_ESTIMATORS",
    "MAX_EXP_LOG_RATIO",
    "OBJECTIVES",
    "OBJECTIVE_PRESETS",
    "AdvantageScale",
    "CorrectedTerms",
    "CorrectionMode",
    "KLEstimator",
    "KLRewardPenalty",
    "Objective",
    "ObjectiveSpec",
    "RolloutCorrection",
    "aggregate_constant",
    "aggregate_sequence_mean",
    "aggregate_token_mean",
    "cispo_loss",
    "correct_rollout",
    "dr_grpo_loss",
    "exp_with_linear_tail",
    "get_objective",
    "gmpo_loss",
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
    "mismatch_stats",
    "objective_gradient",
    "objective_loss",
    "objective_presets",
    "per_token_advantages",
    "register",
    "resolve_objective",
    "reward_kl_penalty",
    "sapo_loss",
    "sequence_log_ratio",
    "sequence_ratio",
    "validate_spec",
]

"""RL objectives: group advantages (Eq. 6), GSPO (Eqs. 5, 7) and the GRPO baseline (Eq. 2)."""

from __future__ import annotations

from gspo_lightning.objectives.advantages import group_advantages
from gspo_lightning.objectives.grpo import grpo_loss
from gspo_lightning.objectives.gspo import gspo_loss, sequence_log_ratio

__all__ = ["group_advantages", "grpo_loss", "gspo_loss", "sequence_log_ratio"]

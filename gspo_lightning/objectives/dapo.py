"""DAPO's token-level loss (Yu et al., 2025, arXiv 2503.14476, Eq. 8): GRPO's surrogate, one global token mean."""

from __future__ import annotations

from torch import Tensor

from gspo_lightning.objectives.aggregation import aggregate_token_mean
from gspo_lightning.objectives.grpo import grpo_token_objective, token_surrogate_reference
from gspo_lightning.objectives.registry import Objective, register


def grpo_token_mean_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """``-sum_i sum_t min(w_i,t A_i, clip(w_i,t) A_i) / sum_i |y_i|`` over the minibatch: a response weighs
    ``|y_i| / sum_j |y_j|``, so long responses count more than under Eq. 2. Arguments and stats as ``grpo_loss``.
    """
    token_objective, token_mask, stats = grpo_token_objective(
        logprobs, old_logprobs, advantages, mask, eps_low, eps_high
    )  # [N, T], [N, T]
    return -aggregate_token_mean(token_objective, token_mask), stats


def dapo_reference_loss(logprobs, old_logprobs, advantages, mask, eps_low, eps_high):
    terms = [t for row in token_surrogate_reference(logprobs, old_logprobs, advantages, mask, eps_low, eps_high)
             for t in row]  # fmt: skip
    return -(sum(terms) / len(terms)) if terms else logprobs.sum() * 0.0, {}


register(
    Objective(
        name="dapo",
        loss=grpo_token_mean_loss,
        reference_loss=dapo_reference_loss,
        ratio="token",
        aggregation="token_mean",
        clip_range=(0.2, 0.28),  # DAPO's clip-higher (section 3.1)
        per_token_advantages=True,
        paper="DAPO (Yu et al., 2025, arXiv 2503.14476), Eq. 8: token-level loss, clip-higher eps 0.2 / 0.28",
    )
)

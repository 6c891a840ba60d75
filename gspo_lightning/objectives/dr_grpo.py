"""Dr. GRPO's loss (Liu et al., 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783): GRPO's surrogate
over a constant normaliser, so that no response's weight depends on its length."""

from __future__ import annotations

from torch import Tensor

from gspo_lightning.objectives.aggregation import aggregate_constant
from gspo_lightning.objectives.grpo import grpo_token_objective, token_surrogate_reference
from gspo_lightning.objectives.registry import Objective, register


def dr_grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    max_tokens: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``-sum_i sum_t min(w_i,t A_i, clip(w_i,t) A_i) / (N * max_tokens)``: no 1/|y_i| length normalisation (N
    counts all rows, empty ones included). ``max_tokens`` defaults to ``T = mask.shape[1]``; ``GSPOModule`` passes
    the generation budget, so that the normaliser is the same in every minibatch. Dr. GRPO also drops the std from
    the advantages (``sampler.advantage_scale: none``). Other arguments and stats as ``grpo_loss``.
    """
    token_objective, token_mask, stats = grpo_token_objective(
        logprobs, old_logprobs, advantages, mask, eps_low, eps_high
    )  # [N, T], [N, T]
    return -aggregate_constant(token_objective, token_mask, max_tokens), stats


def dr_grpo_reference_loss(logprobs, old_logprobs, advantages, mask, eps_low, eps_high, max_tokens=None):
    rows = token_surrogate_reference(logprobs, old_logprobs, advantages, mask, eps_low, eps_high)
    budget = mask.shape[1] if max_tokens is None else max_tokens
    return -sum(t for row in rows for t in row) / (len(rows) * budget), {}


register(
    Objective(
        name="dr_grpo",
        loss=dr_grpo_loss,
        reference_loss=dr_grpo_reference_loss,
        ratio="token",
        aggregation="constant",
        clip_range=(0.2, 0.27),
        per_token_advantages=True,
        options={"max_tokens": None},
        paper="Dr. GRPO (Liu et al., 2025, arXiv 2503.20783), section 3.1: the 1/|o_i| and std terms removed",
    )
)

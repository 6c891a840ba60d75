"""CISPO (MiniMax-M1, arXiv 2506.13585, Eq. 4): clip the importance-sampling weight, not the token's update.

    J_CISPO = E[ 1 / sum_i |o_i| * sum_i sum_t sg( clip(r_i,t, 1 - eps_low, 1 + eps_high) ) A_i,t log pi_theta(o_i,t) ]

Every token keeps its gradient (a REINFORCE term weighted by its truncated ratio); PPO-style clipping would drop
the gradient of exactly the rare tokens whose ratio moved most. Normalised by the minibatch's token count, as the
paper's Eq. 4. Choices where the paper leaves a value open (documented): eps_low = 1.0, so the weight has no lower
bound ("we did not impose a lower bound", section 3.1); eps_high = 0.28, DAPO's clip-higher value (MiniMax-M1
tunes it and publishes none). ``clip_frac`` counts the tokens whose weight was truncated (their gradient is damped,
not removed).
"""

from __future__ import annotations

from torch import Tensor

from gspo_lightning.objectives.aggregation import aggregate_token_mean
from gspo_lightning.objectives.clipping import (
    exp_with_linear_tail,
    reference_token_terms,
    surrogate_stats,
    token_log_ratio,
    validate_shapes,
)
from gspo_lightning.objectives.gspo import sequence_log_ratio
from gspo_lightning.objectives.gspo_token import per_token_advantages
from gspo_lightning.objectives.registry import Objective, register


def cispo_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """``-J_CISPO`` (module docstring). Arguments as ``grpo_loss``; the weight is clipped to
    ``[1 - eps_low, 1 + eps_high]``. Its value is not a surrogate of the return, only its gradient is."""
    validate_shapes(logprobs, old_logprobs, advantages, mask, per_token_advantages=True)
    token_mask = mask != 0  # [N, T]
    lengths = token_mask.sum(dim=1).float()  # [N]
    ratio = exp_with_linear_tail(token_log_ratio(logprobs.detach(), old_logprobs, token_mask))  # [N, T]
    weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)  # [N, T] no gradient: sg[.]
    terms = weight * per_token_advantages(advantages, token_mask) * logprobs.float()  # [N, T]
    loss = -aggregate_token_mean(terms, token_mask)  # []
    truncated_low = (ratio < 1.0 - eps_low) & token_mask  # [N, T]
    truncated_high = (ratio > 1.0 + eps_high) & token_mask  # [N, T]
    log_ratio = sequence_log_ratio(logprobs.detach(), old_logprobs, mask)  # [N]
    stats = surrogate_stats(truncated_low.sum(), truncated_high.sum(), lengths, ratio, token_mask, log_ratio, lengths > 0)
    return loss, stats


def cispo_reference_loss(logprobs, old_logprobs, advantages, mask, eps_low, eps_high):
    def weighted(ratio, advantage, logprob):
        return ratio.detach().clamp(1 - eps_low, 1 + eps_high) * advantage * logprob

    rows = reference_token_terms(logprobs, old_logprobs, advantages, mask, weighted)
    terms = [term for row in rows for term in row]
    return -(sum(terms) / len(terms)) if terms else logprobs.sum() * 0.0, {}


register(
    Objective(
        name="cispo",
        loss=cispo_loss,
        reference_loss=cispo_reference_loss,
        ratio="token",
        aggregation="token_mean",
        clip_range=(1.0, 0.28),
        clip_bounds=((0.0, 1.5), (0.0, 10.0)),  # eps_low = 1: no lower bound on the weight
        per_token_advantages=True,
        paper="CISPO (MiniMax-M1, arXiv 2506.13585), Eq. 4",
    )
)

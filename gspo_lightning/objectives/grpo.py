"""GRPO, the token-level baseline (GSPO paper Eq. 2), and the aggregations that DAPO and Dr. GRPO use instead.

The three losses share one token-level clipped surrogate ``min(w_i,t A_i, clip(w_i,t) A_i)``; they differ only
in how its tokens are aggregated (see ``aggregation``), which changes how much each response weighs.
"""

from __future__ import annotations

from torch import Tensor

from gspo_lightning.objectives.aggregation import (
    aggregate_constant,
    aggregate_sequence_mean,
    aggregate_token_mean,
    masked_values,
)
from gspo_lightning.objectives.clipping import (
    clip_fraction_stats,
    clipped_surrogate,
    exp_with_linear_tail,
    mean_over_valid,
    ratio_stats,
    token_log_ratio,
    validate_clip_range,
    validate_shapes,
)
from gspo_lightning.objectives.gspo import sequence_log_ratio
from gspo_lightning.objectives.gspo_token import per_token_advantages


def grpo_token_objective(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """The per-token clipped surrogate of Eq. 2, before aggregation.

    Returns ``(token_objective, token_mask, stats)``: [N, T] float32 (exact 0 on padding), [N, T] bool and
    the detached stats of ``grpo_loss``. The ratio ``w_i,t`` is ``exp_with_linear_tail`` of the float32
    token log-ratio: exact ``exp`` up to a log-ratio of 20, finite beyond it (see that function).
    """
    validate_clip_range(eps_low, eps_high)
    validate_shapes(logprobs, old_logprobs, advantages, mask, per_token_advantages=True)
    token_mask = mask != 0  # [N, T]
    lengths = token_mask.sum(dim=1).float()  # [N]
    valid = lengths > 0  # [N]
    token_ratio = exp_with_linear_tail(token_log_ratio(logprobs, old_logprobs, token_mask))  # [N, T], 1 on padding
    token_objective, clipped_low, clipped_high = clipped_surrogate(
        token_ratio, per_token_advantages(advantages, token_mask), eps_low, eps_high
    )  # [N, T] each

    stats = clip_fraction_stats(
        (clipped_low & token_mask).sum(), (clipped_high & token_mask).sum(), lengths.sum()
    )
    stats.update(ratio_stats(token_ratio, token_mask))
    log_ratio = sequence_log_ratio(logprobs.detach(), old_logprobs, mask)  # [N]
    stats["seq_log_ratio_abs_mean"] = mean_over_valid(log_ratio.abs(), valid)
    stats["num_empty"] = (~valid).sum().float()
    stats = {name: value.detach().float() for name, value in stats.items()}
    return masked_values(token_objective, token_mask), token_mask, stats


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``-J_GRPO``: per-token clipped surrogate, mean over each response's tokens, mean over responses (Eq. 2).

    The token ratio is ``w_i,t = exp(log pi_theta - log pi_old)`` (float32), each token clipped on its own.
    Responses weigh ``1 / N_valid`` each; empty responses are left out and counted. ``old_logprobs`` and
    ``advantages`` are constants of the objective (detached). Padding contributes nothing, even NaN/inf values.

    Args:
        logprobs, old_logprobs, mask: [N, T]; mask nonzero on response tokens (bool, int or float).
        advantages: [N] one advantage per response, shared by its tokens (Eq. 6), or [N, T] one per token (e.g.
            weighted by a rollout correction).
        eps_low, eps_high: clip range ``[1 - eps_low, 1 + eps_high]``, each in (0, 1).

    Returns:
        ``(loss, stats)`` with the keys of ``gspo_loss``: ``clip_frac*`` count tokens whose own ratio is
        clipped (over all response tokens), ``ratio_mean/min/max`` are over response tokens (1 when none),
        ``seq_log_ratio_abs_mean`` is the mean over responses of |mean token log-ratio| (GSPO's |log s_i|,
        for comparability), ``num_empty`` counts responses without tokens.
    """
    token_objective, token_mask, stats = grpo_token_objective(
        logprobs, old_logprobs, advantages, mask, eps_low, eps_high
    )  # [N, T], [N, T]
    return -aggregate_sequence_mean(token_objective, token_mask), stats


def grpo_token_mean_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """DAPO's token-level loss (Yu et al., 2025, arXiv 2503.14476): GRPO's surrogate, one global token mean.

    ``-sum_i sum_t min(w_i,t A_i, clip(w_i,t) A_i) / sum_i |y_i|`` over the minibatch: a response weighs
    ``|y_i| / sum_j |y_j|``, so long responses count more than under Eq. 2. Arguments and stats as ``grpo_loss``.
    """
    token_objective, token_mask, stats = grpo_token_objective(
        logprobs, old_logprobs, advantages, mask, eps_low, eps_high
    )  # [N, T], [N, T]
    return -aggregate_token_mean(token_objective, token_mask), stats


def dr_grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    max_tokens: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Dr. GRPO's loss (Liu et al., 2025, arXiv 2503.20783): GRPO's surrogate over a constant normaliser.

    ``-sum_i sum_t min(w_i,t A_i, clip(w_i,t) A_i) / (N * max_tokens)``: no 1/|y_i| length normalisation
    (N counts all rows, empty ones included). ``max_tokens`` defaults to ``T = mask.shape[1]``; pass the
    generation budget to keep it the same across minibatches. Dr. GRPO also drops the std from the advantages
    (``group_advantages(..., scale="none")``). Other arguments and stats as ``grpo_loss``.
    """
    token_objective, token_mask, stats = grpo_token_objective(
        logprobs, old_logprobs, advantages, mask, eps_low, eps_high
    )  # [N, T], [N, T]
    return -aggregate_constant(token_objective, token_mask, max_tokens), stats

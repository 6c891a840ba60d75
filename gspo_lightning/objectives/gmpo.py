"""GMPO (Geometric-Mean Policy Optimization, Zhao et al., 2025, arXiv 2507.20673, Eq. 4): the geometric mean of
the token ratios, each clipped in log space, in place of GRPO's arithmetic mean.

    J_GMPO = E[ 1/G sum_i A_i * exp( 1/|o_i| sum_t sgn(A_i) min( sgn(A_i) log r_i,t, sgn(A_i) clip(log r_i,t,
                                                                  -eps_low, eps_high) ) ) ]

The min with sgn(A) is PPO's one-sided trust region per token, applied before the mean: a token whose ratio left
the range on the side the advantage pushes it contributes a constant (no gradient). The geometric mean is far less
sensitive to one outlier token than the arithmetic one, so the range is wide: (e^-0.4, e^0.4), the paper's
section 4 (eps are in log space here). Each response weighs 1/G like GSPO; its ratio is sequence level.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gspo_lightning.objectives.clipping import (
    exp_with_linear_tail,
    mean_over_valid,
    surrogate_stats,
    token_log_ratio,
    validate_shapes,
)
from gspo_lightning.objectives.registry import Objective, register


def gmpo_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """``-J_GMPO`` (module docstring): ``advantages`` [N], ``eps_low`` / ``eps_high`` > 0 in log space. Stats as
    ``gspo_loss``'s, ``ratio_*`` of the clipped geometric mean, ``clip_frac`` counting clipped tokens."""
    validate_shapes(logprobs, old_logprobs, advantages, mask)
    token_mask = mask != 0  # [N, T]
    lengths = token_mask.sum(dim=1).float()  # [N]
    valid = lengths > 0  # [N]
    log_ratio = token_log_ratio(logprobs, old_logprobs, token_mask)  # [N, T]
    sign = torch.sign(advantages.detach().float())[:, None]  # [N, 1]
    clipped = log_ratio.clamp(-eps_low, eps_high)  # [N, T]
    bounded = sign * torch.minimum(sign * log_ratio, sign * clipped)  # [N, T] 0 where A = 0
    mean_log_ratio = torch.where(token_mask, bounded, 0.0).sum(-1) / lengths.clamp(min=1)  # [N]
    ratio = exp_with_linear_tail(mean_log_ratio)  # [N]
    loss = -mean_over_valid(advantages.detach().float() * ratio, valid)  # []
    clipped_low = (sign < 0) & (log_ratio < -eps_low) & token_mask  # [N, T] constant: no gradient
    clipped_high = (sign > 0) & (log_ratio > eps_high) & token_mask  # [N, T]
    unclipped = torch.where(token_mask, log_ratio, 0.0).sum(-1).detach() / lengths.clamp(min=1)  # [N] log s_i
    stats = surrogate_stats(clipped_low.sum(), clipped_high.sum(), lengths, ratio, valid, unclipped, valid)
    return loss, stats


def gmpo_reference_loss(logprobs, old_logprobs, advantages, mask, eps_low, eps_high):
    terms = []
    for i in range(len(logprobs)):
        tokens = [t for t in range(logprobs.shape[1]) if mask[i, t] != 0]
        if not tokens:
            continue
        a = advantages[i].double()
        sign = torch.sign(a)
        logs = []
        for t in tokens:
            log_r = logprobs[i, t].double() - old_logprobs[i, t].double()
            logs.append(sign * torch.minimum(sign * log_r, sign * log_r.clamp(-eps_low, eps_high)))
        terms.append(a * torch.exp(sum(logs) / len(logs)))
    return -(sum(terms) / len(terms)) if terms else logprobs.sum() * 0.0, {}


register(
    Objective(
        name="gmpo",
        loss=gmpo_loss,
        reference_loss=gmpo_reference_loss,
        ratio="sequence",
        aggregation="sequence_mean",
        clip_range=(0.4, 0.4),
        clip_bounds=((0.0, 10.0), (0.0, 10.0)),  # log space
        paper="GMPO (Zhao et al., 2025, arXiv 2507.20673), Eq. 4; section 4's range (e^-0.4, e^0.4)",
    )
)

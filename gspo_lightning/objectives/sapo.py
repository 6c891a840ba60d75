"""SAPO (Soft Adaptive Policy Optimization, Gao et al., Qwen team, 2025, arXiv 2511.20347): a smooth,
temperature-controlled gate in place of the hard clip.

    J_SAPO = E[ 1/G sum_i 1/|y_i| sum_t f_i,t(r_i,t) A_i,t ],   f(r) = (4 / tau) * sigmoid(tau (r - 1)),
    tau = tau_pos where A > 0, tau_neg where A < 0 (paper defaults 1.0 and 1.05)

f'(1) = 1: on-policy tokens get exactly the policy-gradient term; as a token's ratio leaves 1 its gradient decays
smoothly (f'(r) = 4 s (1 - s), s = sigmoid(tau (r - 1))) instead of dropping to zero at a band edge, so one
off-policy token damps only itself, and not its whole response as under GSPO's sequence clip. tau_neg > tau_pos
decays negative-advantage updates faster (they raise many unsampled tokens' logits). SAPO has no clip range:
eps_low / eps_high only set the diagnostics' clip fractions. Its ``clip_frac`` counts the tokens whose gate
passes less than half of the on-policy gradient (f'(r) < 1/2; our choice of threshold).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gspo_lightning.objectives.aggregation import aggregate_sequence_mean
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


def soft_gate(ratio: Tensor, tau: Tensor) -> Tensor:
    """``(4 / tau) * sigmoid(tau (ratio - 1))``, elementwise."""
    return torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


def sapo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``-J_SAPO`` (module docstring). Arguments as ``grpo_loss``, ``eps_*`` unused."""
    validate_shapes(logprobs, old_logprobs, advantages, mask, per_token_advantages=True)
    token_mask = mask != 0  # [N, T]
    lengths = token_mask.sum(dim=1).float()  # [N]
    ratio = exp_with_linear_tail(token_log_ratio(logprobs, old_logprobs, token_mask))  # [N, T]
    a = per_token_advantages(advantages, token_mask)  # [N, T]
    tau = torch.where(a > 0, tau_pos, tau_neg)  # [N, T]
    loss = -aggregate_sequence_mean(soft_gate(ratio, tau) * a, token_mask)  # []
    slope = torch.sigmoid(tau * (ratio.detach() - 1.0))  # [N, T]
    damped = (4.0 * slope * (1.0 - slope) < 0.5) & token_mask & (a != 0)  # [N, T] less than half the gradient
    log_ratio = sequence_log_ratio(logprobs.detach(), old_logprobs, mask)  # [N]
    stats = surrogate_stats((damped & (ratio < 1)).sum(), (damped & (ratio > 1)).sum(), lengths, ratio, token_mask,
                            log_ratio, lengths > 0)  # fmt: skip
    return loss, stats


def sapo_reference_loss(logprobs, old_logprobs, advantages, mask, eps_low, eps_high, tau_pos=1.0, tau_neg=1.05):
    def gated(ratio, advantage, logprob):
        tau = torch.tensor(tau_pos if advantage > 0 else tau_neg, dtype=torch.float64)
        return soft_gate(ratio, tau) * advantage

    rows = [terms for terms in reference_token_terms(logprobs, old_logprobs, advantages, mask, gated) if terms]
    responses = [sum(terms) / len(terms) for terms in rows]
    return -(sum(responses) / len(responses)) if responses else logprobs.sum() * 0.0, {}


register(
    Objective(
        name="sapo",
        loss=sapo_loss,
        reference_loss=sapo_reference_loss,
        ratio="token",
        aggregation="sequence_mean",
        clip_range=(0.2, 0.27),  # not used by the loss: the diagnostics' clip fractions only
        per_token_advantages=True,
        options={"tau_pos": 1.0, "tau_neg": 1.05},
        paper="SAPO (Gao et al., 2025, arXiv 2511.20347), the soft gate f(r) = 4/tau sigmoid(tau (r - 1))",
    )
)

"""Rollout-training mismatch: the engine that sampled is not the trainer that computes pi_old.

An inference engine (vLLM, or ``generate`` in another precision) samples from pi_engine, which differs from the
trainer's pi_old by kernels and rounding. The objective's ratios are taken against pi_old, so samples drawn from
pi_engine carry an extra importance weight pi_old / pi_engine that the plain objective ignores (Yao et al. 2025,
"Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"). Three corrections, each a function
of the two log-probs alone, usable with every objective:

- ``tis`` (truncated importance sampling): each token's term weighted by ``min(pi_old / pi_engine, C)``
  (detached). For a sequence-ratio objective (GSPO) the weight of a response is its length-normalised ratio
  ``min(exp(mean_t log(pi_old / pi_engine)), C)``, the form GSPO's own s_i takes (Eq. 7), so that its range does
  not depend on the response's length (our choice: the TIS paper only defines the token weight).
- ``mis`` (masked importance sampling, sequence level): responses whose length-normalised ratio falls outside
  ``[1 / C, C]`` are left out of the loss, the natural fit for GSPO's sequence ratio.
- ``token_mask``: tokens whose ratio falls outside ``[1 / C, C]`` are left out.

A weight w > 0 scales the advantage: ``min(r w A, clip(r) w A) = w min(r A, clip(r) A)``, so TIS is the
objective's own terms, each weighted by w. Left out means removed from the response mask: the term and its
tokens do not count (in the loss nor its normalisers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from gspo_lightning.objectives.clipping import exp_with_linear_tail
from gspo_lightning.objectives.gspo import sequence_log_ratio
from gspo_lightning.objectives.kl import k3_from_log_ratio

CorrectionMode = Literal["off", "tis", "mis", "token_mask"]
CORRECTION_MODES: tuple[str, ...] = ("off", "tis", "mis", "token_mask")


@dataclass(frozen=True)
class RolloutCorrection:
    """How training corrects for the engine's sampling distribution differing from the trainer's pi_old.

    Attributes:
        mode: ``off`` (default), ``tis``, ``mis`` or ``token_mask`` (see the module docstring); YAML reads an
            unquoted ``off`` as false, which means ``off``.
        threshold: C > 1: the TIS cap, or the bounds [1 / C, C] of the masks.
    """

    mode: CorrectionMode | bool = "off"
    threshold: float = 2.0

    def __post_init__(self) -> None:
        if self.mode is False:
            object.__setattr__(self, "mode", "off")  # frozen: the one place the value is normalised
        if self.mode not in CORRECTION_MODES:
            raise ValueError(f"rollout_correction.mode must be one of {list(CORRECTION_MODES)}, got {self.mode!r}")
        if not (isinstance(self.threshold, int | float) and self.threshold > 1):
            raise ValueError(f"rollout_correction.threshold must be a number > 1, got {self.threshold!r}")


@dataclass(frozen=True)
class CorrectedTerms:
    """The objective's inputs after the correction.

    Attributes:
        advantages: [N] (sequence-ratio objectives) or [N, T] (token-level), the advantages times the weights.
        mask: [N, T] bool, the response mask without what the correction left out.
        stats: ``masked_frac`` (fraction of response tokens left out) and ``truncated_frac`` (fraction of
            weights capped at C), detached float32 scalars.
    """

    advantages: Tensor
    mask: Tensor
    stats: dict[str, Tensor]


def correct_rollout(
    correction: RolloutCorrection,
    old_logprobs: Tensor,
    engine_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    sequence_level: bool,
) -> CorrectedTerms:
    """Apply ``correction`` to one minibatch.

    Args:
        old_logprobs: [N, T] the trainer's pi_old.
        engine_logprobs: [N, T] the engine's log-probs of the same tokens.
        advantages: [N] or [N, T].
        mask: [N, T] nonzero on response tokens.
        sequence_level: the objective's ratio is one per response (GSPO): TIS then weighs responses, not tokens.
    """
    token_mask = mask != 0  # [N, T]
    log_ratio = torch.where(token_mask, old_logprobs.float() - engine_logprobs.float(), 0.0).detach()  # [N, T]
    tokens = token_mask.sum().clamp(min=1)
    if correction.mode == "off":
        return CorrectedTerms(advantages, token_mask, _stats(token_mask, token_mask, torch.zeros(()), tokens))
    bound = torch.log(torch.tensor(float(correction.threshold)))
    if correction.mode == "tis":
        return _truncated_importance_sampling(log_ratio, advantages, token_mask, bound, sequence_level, tokens)
    if correction.mode == "mis":
        per_response = sequence_log_ratio(old_logprobs.detach(), engine_logprobs.detach(), mask)  # [N]
        keep = (per_response.abs() <= bound)[:, None] & token_mask  # [N, T]
    else:
        keep = (log_ratio.abs() <= bound) & token_mask  # [N, T]
    return CorrectedTerms(advantages, keep, _stats(keep, token_mask, torch.zeros(()), tokens))


def _truncated_importance_sampling(
    log_ratio: Tensor, advantages: Tensor, token_mask: Tensor, bound: Tensor, sequence_level: bool, tokens: Tensor
) -> CorrectedTerms:
    lengths = token_mask.sum(-1)  # [N]
    if sequence_level:
        mean_log_ratio = log_ratio.sum(-1) / lengths.clamp(min=1)  # [N] length-normalised, as GSPO's s_i
        capped = mean_log_ratio > bound  # [N]
        weight = exp_with_linear_tail(torch.minimum(mean_log_ratio, bound))  # [N]
        truncated = (capped.float() * lengths).sum()  # tokens of capped responses
        per_response = weight if advantages.dim() == 1 else weight[:, None]  # [N] or [N, 1]
        return CorrectedTerms(advantages * per_response, token_mask, _stats(token_mask, token_mask, truncated, tokens))
    capped = (log_ratio > bound) & token_mask  # [N, T]
    weight = torch.where(token_mask, exp_with_linear_tail(torch.minimum(log_ratio, bound)), 1.0)  # [N, T]
    per_token = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(weight)  # [N, T]
    return CorrectedTerms(per_token * weight, token_mask, _stats(token_mask, token_mask, capped.sum(), tokens))


def _stats(kept: Tensor, token_mask: Tensor, truncated: Tensor, tokens: Tensor) -> dict[str, Tensor]:
    left_out = (token_mask & ~kept).sum()
    return {"masked_frac": (left_out / tokens).float(), "truncated_frac": (truncated / tokens).float()}


def mismatch_stats(old_logprobs: Tensor, engine_logprobs: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """How far the engine's distribution is from the trainer's on the sampled tokens (detached float32).

    ``kl``: mean k3 estimate of KL(pi_engine || pi_trainer) over response tokens (the samples come from the
    engine); ``log_ratio_p05`` .. ``log_ratio_p95`` and ``log_ratio_abs_max``: quantiles of each response's
    length-normalised log(pi_trainer / pi_engine), the log of GSPO's sequence ratio between the two.
    """
    token_mask = mask != 0  # [N, T]
    log_ratio = torch.where(token_mask, old_logprobs.float() - engine_logprobs.float(), 0.0).detach()  # [N, T]
    kl = k3_from_log_ratio(log_ratio)  # [N, T] 0 on padding
    stats = {"kl": kl.sum() / token_mask.sum().clamp(min=1)}
    valid = token_mask.any(-1)  # [N]
    per_response = sequence_log_ratio(old_logprobs.detach(), engine_logprobs.detach(), mask)[valid]  # [N_valid]
    if per_response.numel() == 0:
        per_response = torch.zeros(1)
    quantiles = torch.quantile(per_response.float(), torch.tensor([0.05, 0.5, 0.95], device=per_response.device))
    stats.update(log_ratio_p05=quantiles[0], log_ratio_p50=quantiles[1], log_ratio_p95=quantiles[2])
    stats["log_ratio_abs_max"] = per_response.abs().max()
    return {name: value.detach().float() for name, value in stats.items()}

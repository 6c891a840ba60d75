"""How per-token values (clipped surrogates, KL estimates) become one number: the choice changes the objective.

- ``aggregate_sequence_mean``: mean over each response's tokens, then over responses. Every response weighs
  1/N whatever its length: GRPO (GSPO paper Eq. 2), GSPO-token (Eq. 13), and the only aggregation under which
  a sequence-level ratio is GSPO (Eqs. 5, 7).
- ``aggregate_token_mean``: one mean over all response tokens of the minibatch, so a response weighs
  ``|y_i| / sum_j |y_j|``: DAPO's token-level policy-gradient loss (Yu et al., 2025, arXiv 2503.14476).
- ``aggregate_constant``: the sum over all response tokens divided by the constant ``N * max_tokens``: Dr. GRPO
  (Liu et al., 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783), which removes the 1/|y_i| bias.

All take ``token_values`` [N, T] and a boolean ``token_mask`` [N, T]; padding contributes nothing to the value
or the gradient, even NaN/inf there (``torch.where``, not a multiplication by the mask). Pure functions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gspo_lightning.objectives.clipping import mean_over_valid


def masked_values(token_values: Tensor, token_mask: Tensor) -> Tensor:
    """``token_values`` with padding replaced by exact zeros (value and gradient)."""
    return torch.where(token_mask, token_values, torch.zeros_like(token_values))  # [N, T]


def aggregate_sequence_mean(token_values: Tensor, token_mask: Tensor) -> Tensor:
    """``1/N_valid * sum_i 1/|y_i| * sum_t v_i,t`` (Eqs. 2, 13); responses without tokens are left out.

    0 (still attached to the graph) when no response has tokens.
    """
    lengths = token_mask.sum(dim=1).float()  # [N]
    response_means = masked_values(token_values, token_mask).sum(dim=1) / lengths.clamp(min=1.0)  # [N]
    return mean_over_valid(response_means, lengths > 0)  # []


def aggregate_token_mean(token_values: Tensor, token_mask: Tensor) -> Tensor:
    """``sum_i sum_t v_i,t / sum_i |y_i|`` over the minibatch (DAPO); 0 when there are no response tokens."""
    total_tokens = token_mask.sum().float()  # []
    return masked_values(token_values, token_mask).sum() / total_tokens.clamp(min=1.0)  # []


def aggregate_constant(token_values: Tensor, token_mask: Tensor, max_tokens: int | None = None) -> Tensor:
    """``sum_i sum_t v_i,t / (N * max_tokens)`` (Dr. GRPO): a normaliser that depends on no length.

    ``N`` counts every row, empty responses included (they add 0 to the sum); ``max_tokens`` defaults to
    ``T = token_mask.shape[1]`` and should be the generation budget so that the normaliser stays the same
    across minibatches. 0 when N * max_tokens is 0.
    """
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got max_tokens={max_tokens}")
    budget = token_mask.shape[1] if max_tokens is None else max_tokens
    normaliser = max(token_mask.shape[0] * budget, 1)
    return masked_values(token_values, token_mask).sum() / normaliser  # []

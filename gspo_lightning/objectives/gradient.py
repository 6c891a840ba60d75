"""The objective's gradient with respect to some responses' log-probs, from those log-probs alone.

The chunked LM head (:mod:`gspo_lightning.chunked_logprobs`) calls this while a chunk's softmax still exists, so
it can form the head's gradients in forward instead of recomputing the chunk in backward. That is sound because
every objective of :func:`objective_loss` is a sum of per-response terms whose normalisers are fixed by the
masks: the other responses' values do not change these rows' gradient, so pi_old's log-probs stand in for them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from gspo_lightning.objectives.spec import ObjectiveSpec, objective_loss


def objective_gradient(
    spec: ObjectiveSpec,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    ref_logprobs: Tensor | None = None,
) -> Callable[[Tensor, slice], Tensor]:
    """d loss / d logprobs of a slice of responses, for the loss ``objective_loss(spec, ...)`` of all of them:
    the ``predict_upstream`` of :func:`gspo_lightning.chunked_logprobs.chunked_head_logprobs`.

    Args:
        old_logprobs: [n, R] pi_old's log-probs (they stand in for the responses outside the slice).
        advantages: [n] (or [n, R] for per-token advantages).
        mask: [n, R] response mask.
        ref_logprobs: [n, R] the reference policy's log-probs, with a KL penalty.
    """

    def predict(logprobs: Tensor, rows: slice | Tensor) -> Tensor:  # [k, R] -> [k, R]
        index = torch.arange(old_logprobs.shape[0], device=old_logprobs.device)[rows]  # [k]
        with torch.enable_grad():
            chunk = logprobs.detach().requires_grad_()
            dtype = torch.promote_types(old_logprobs.dtype, chunk.dtype)
            full = old_logprobs.detach().to(dtype).index_copy(0, index, chunk.to(dtype))  # [n, R]
            loss, _ = objective_loss(spec, full, old_logprobs, advantages, mask, eps_low, eps_high, ref_logprobs)
            return torch.autograd.grad(loss, chunk)[0]

    return predict

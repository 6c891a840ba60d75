"""Log-probs of chosen tokens through the LM head, chunked over tokens, without the [N, V] float32 logits.

The naive path ``log_softmax((hidden @ W.T).float())`` holds several [N, V] float32 tensors at once (the
logits, the log-softmax output kept for backward, and in backward its gradient and the logits' gradient). For
a 152k vocabulary and 8 x 1024 tokens each is 5 GB. Here the head is applied to ``chunk_size`` tokens at a time:
forward keeps only the log-sum-exp [N], backward recomputes each chunk's logits and turns them into gradients
for the hidden states and the head weight straight away, so at most one chunk's [C, V] scores exist at a time.

The per-token result is the same function as :func:`gspo_lightning.logprobs.token_logprobs` of the head's
logits: ``log softmax(logits / temperature)[token]`` in float32, with the matmul done in the dtype the naive
path would use (the weight's, or autocast's when it is on), so values and gradients agree to float tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class _HeadSpec:
    """How the head's matmul is computed, fixed at forward time so backward recomputes the same logits."""

    temperature: float
    chunk_size: int
    compute_dtype: torch.dtype


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype ``F.linear(hidden, weight)`` would run in: autocast's when enabled, else the weight's."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


def _chunk_scores(hidden: Tensor, weight: Tensor, bias: Tensor | None, spec: _HeadSpec) -> Tensor:
    """float32 ``logits / temperature`` of one chunk: [C, H] -> [C, V]."""
    with torch.autocast(hidden.device.type, enabled=False):  # the dtype is chosen explicitly below
        logits = hidden.to(spec.compute_dtype) @ weight.to(spec.compute_dtype).T  # [C, V]
        if bias is not None:
            logits = logits + bias.to(spec.compute_dtype)
    return logits.float().div_(spec.temperature)  # [C, V]


class _ChunkedHeadLogprobs(torch.autograd.Function):
    """``(hidden [N, H], weight [V, H], bias [V] | None, tokens [N]) -> (logprobs [N], entropy [N])``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, spec: _HeadSpec, with_entropy: bool):
        logprobs = hidden.new_empty(hidden.shape[0], dtype=torch.float32)  # [N]
        log_normaliser = torch.empty_like(logprobs)  # [N] logsumexp, the only thing backward needs
        entropy = torch.zeros_like(logprobs)  # [N]
        for begin in range(0, hidden.shape[0], spec.chunk_size):
            rows = slice(begin, begin + spec.chunk_size)
            scores = _chunk_scores(hidden[rows], weight, bias, spec)  # [C, V]
            log_normaliser[rows] = torch.logsumexp(scores, dim=-1)  # [C]
            logprobs[rows] = scores.gather(-1, tokens[rows, None]).squeeze(-1) - log_normaliser[rows]  # [C]
            if with_entropy:
                probs = scores.sub_(log_normaliser[rows, None]).exp_()  # [C, V] softmax, in place
                entropy[rows] = torch.special.entr(probs).sum(-1)  # [C] sum of -p log p
        ctx.save_for_backward(hidden, weight, bias, tokens, log_normaliser)
        ctx.spec = spec
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, bias, tokens, log_normaliser = ctx.saved_tensors
        spec: _HeadSpec = ctx.spec
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None  # [N, H]
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None  # [V, H]
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_bias else None  # [V]
        grad_logprobs = grad_logprobs.float()  # [N]
        for begin in range(0, hidden.shape[0], spec.chunk_size):
            rows = slice(begin, begin + spec.chunk_size)
            probs = _chunk_scores(hidden[rows], weight, bias, spec).sub_(log_normaliser[rows, None]).exp_()  # [C, V]
            # d logp(token) / d scores = onehot(token) - softmax; d scores / d logits = 1 / temperature
            grad_scores = probs.mul_(-grad_logprobs[rows, None])  # [C, V]
            grad_scores.scatter_add_(-1, tokens[rows, None], grad_logprobs[rows, None])
            grad_scores.div_(spec.temperature)
            with torch.autocast(hidden.device.type, enabled=False):
                grad_logits = grad_scores.to(spec.compute_dtype)  # [C, V] as the naive matmul's backward sees it
                if need_hidden:
                    grad_hidden[rows] = (grad_logits @ weight.to(spec.compute_dtype)).to(hidden.dtype)  # [C, H]
                if need_weight:
                    grad_weight += (grad_logits.T @ hidden[rows].to(spec.compute_dtype)).float()  # [V, H]
            if need_bias:
                grad_bias += grad_scores.sum(0)
        grad_weight = grad_weight.to(weight.dtype) if need_weight else None
        grad_bias = grad_bias.to(bias.dtype) if need_bias else None
        return grad_hidden, grad_weight, grad_bias, None, None, None


def chunked_head_logprobs(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    bias: Tensor | None = None,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and optionally entropies) of ``tokens`` under ``softmax((hidden @ weight.T + bias) / T)``.

    Args:
        hidden: [..., H] final hidden states (after the model's last norm), one per predicted token.
        weight: [V, H] the LM head's weight.
        tokens: [...] the token each hidden state predicts.
        temperature: the sampling temperature the scores are for.
        chunk_size: tokens whose [chunk_size, V] float32 scores exist at once; trades memory for launches.
        bias: [V] the head's bias, if it has one.
        with_entropy: also return the entropy of each token's distribution (no gradient).
    Returns:
        logprobs: [...] float32, differentiable with respect to ``hidden``, ``weight`` and ``bias``.
        entropy: [...] float32, or None without ``with_entropy``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    spec = _HeadSpec(temperature, chunk_size, _compute_dtype(hidden, weight))
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    logprobs, entropy = _ChunkedHeadLogprobs.apply(
        flat_hidden, weight, bias, tokens.reshape(-1), spec, with_entropy
    )  # [N], [N]
    return logprobs.view(tokens.shape), entropy.view(tokens.shape) if with_entropy else None

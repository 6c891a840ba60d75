"""Shared builders for the objective tests: hand-made batches and the naive-transcription comparison."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

OLD_LOGPROB = -2.0  # old log-probability of every response token; only differences matter


def make_batch(log_ratios: list[list[float]], length: int) -> tuple[Tensor, Tensor, Tensor]:
    """logprobs (leaf, requires grad), old_logprobs and mask for responses with the given per-token log-ratios."""
    delta = torch.tensor([ratios + [0.0] * (length - len(ratios)) for ratios in log_ratios])  # [N, T]
    mask = (torch.arange(length)[None, :] < torch.tensor([len(r) for r in log_ratios])[:, None]).float()  # [N, T]
    old = OLD_LOGPROB * mask  # [N, T]
    return (old + delta).requires_grad_(True), old, mask


def close(actual: Tensor, expected: float | Tensor) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=1e-6, rtol=0)


def random_batch(
    seed: int, lengths: list[int], noise: float, per_token_advantages: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """logprobs (leaf), old_logprobs, advantages ([N], or [N, T] holding NaN on padding) and a bool mask.

    Response tokens get ``logprobs = old + noise * randn``; padding holds huge values (|x| ~ 1e3).
    """
    torch.manual_seed(seed)
    n, length = len(lengths), max(lengths)
    mask = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]  # [N, T] bool
    old = torch.randn(n, length) - 2.0  # [N, T]
    logprobs = torch.where(mask, old + noise * torch.randn(n, length), torch.randn(n, length) * 1e3)  # [N, T]
    if per_token_advantages:
        advantages = torch.where(mask, torch.randn(n, length), torch.full((n, length), float("nan")))  # [N, T]
    else:
        advantages = torch.randn(n)  # [N]
    return logprobs.requires_grad_(True), old, advantages, mask


def compare_with_naive(
    loss_fn: Callable,
    naive_fn: Callable,
    seed: int,
    lengths: list[int],
    noise: float,
    eps: tuple[float, float],
    per_token_advantages: bool = False,
) -> tuple[dict[str, Tensor], int, int, int]:
    """Random padded batch (huge values on padding); loss and gradient must equal the naive loop version's.

    Returns the objective's stats and the naive (clipped_low, clipped_high, total) token counts.
    """
    logprobs, old, advantages, mask = random_batch(seed, lengths, noise, per_token_advantages)
    loss, stats = loss_fn(logprobs, old, advantages, mask, *eps)
    (grad,) = torch.autograd.grad(loss, logprobs)
    reference = logprobs.detach().double().requires_grad_(True)
    expected, low, high, tokens = naive_fn(reference, old.double(), advantages.double(), mask, *eps)
    (expected_grad,) = torch.autograd.grad(expected, reference)

    assert low > 0 and high > 0, "eps should make both clipping sides fire"
    close(loss, expected.float())
    close(grad, expected_grad.float())
    return stats, low, high, tokens


def naive_clip_term(ratio: Tensor, advantage: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, int, int]:
    """``min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)`` with Python's min/max, and which side clips."""
    clipped_ratio = max(1 - eps_low, min(ratio, 1 + eps_high))
    term = min(ratio * advantage, clipped_ratio * advantage)
    return term, int(bool(advantage < 0 and ratio < 1 - eps_low)), int(bool(advantage > 0 and ratio > 1 + eps_high))

from __future__ import annotations

import math

import torch
from torch import Tensor

from gspo_lightning.objectives import grpo_loss
from tests.objectives.helpers import close, compare_with_naive, make_batch


def test_token_level_value_gradient_and_stats() -> None:
    logprobs, old, mask = make_batch([[0.3, -0.3], [0.3, 0.15, -0.3]], length=3)
    loss, stats = grpo_loss(logprobs, old, torch.tensor([1.0, -0.5]), mask, 0.2, 0.2)
    (grad,) = torch.autograd.grad(loss, logprobs)
    up, mid, down = math.exp(0.3), math.exp(0.15), math.exp(-0.3)  # 1.3499, 1.1618, 0.7408
    # Response 0, A = 1: w = 1.3499 > 1.2 -> clipped high, 1.2; w = 0.7408 < 0.8 but A > 0 -> unclipped, 0.7408.
    mean_0 = (1.2 + down) / 2
    # Response 1, A = -0.5: w = 1.3499 > 1.2 but A < 0 -> unclipped, -0.5 * 1.3499; w = 1.1618 in range,
    # -0.5 * 1.1618; w = 0.7408 < 0.8 with A < 0 -> clipped low, 0.8 * -0.5 = -0.4.
    mean_1 = (-0.5 * up - 0.5 * mid - 0.4) / 3
    close(loss, -(mean_0 + mean_1) / 2)
    # d(-J)/d logprob_i,t = -(1/N) (1/|y_i|) A_i w_i,t on unclipped tokens, 0 on clipped ones and padding.
    close(grad, torch.tensor([[0.0, -down / 4, 0.0], [up / 12, mid / 12, 0.0]]))
    close(stats["clip_frac_high"], 1 / 5)
    close(stats["clip_frac_low"], 1 / 5)
    close(stats["clip_frac"], 2 / 5)
    close(stats["ratio_mean"], (2 * up + mid + 2 * down) / 5)
    close(stats["ratio_min"], down)
    close(stats["ratio_max"], up)
    # Mean token log-ratio: 0 for response 0, 0.15 / 3 = 0.05 for response 1 -> mean of |.| = 0.025.
    close(stats["seq_log_ratio_abs_mean"], 0.025)
    close(stats["num_empty"], 0.0)


def test_ratio_one_gives_reinforce_with_group_baseline_gradient() -> None:
    torch.manual_seed(0)
    lengths = [5, 3, 1, 4, 2, 5]
    mask = (torch.arange(5)[None, :] < torch.tensor(lengths)[:, None]).float()  # [6, 5]
    logprobs = torch.randn(6, 5).requires_grad_(True)
    advantages = torch.randn(6)
    loss, stats = grpo_loss(logprobs, logprobs.detach(), advantages, mask, 0.2, 0.27)
    (grad,) = torch.autograd.grad(loss, logprobs)
    # w = 1 everywhere: -J = -mean(A), and d(-J)/d logprob_i,t = -A_i / (N |y_i|) on response tokens.
    close(loss, -advantages.mean())
    close(grad, -advantages[:, None] / (6 * torch.tensor(lengths, dtype=torch.float32)[:, None]) * mask)
    close(stats["clip_frac"], 0.0)
    close(stats["ratio_min"], 1.0)


def test_padding_contributes_nothing_even_when_non_finite() -> None:
    logprobs, old, mask = make_batch([[0.3, -0.3], [0.3, 0.15, -0.3]], length=5)
    advantages = torch.tensor([1.0, -0.5])
    reference, _ = grpo_loss(logprobs, old, advantages, mask, 0.2, 0.2)
    (reference_grad,) = torch.autograd.grad(reference, logprobs)
    garbage = logprobs.detach().clone()
    garbage[0, 2:] = torch.tensor([float("nan"), float("inf"), 1e30])
    garbage[1, 3:] = torch.tensor([float("-inf"), float("nan")])
    garbage.requires_grad_(True)
    loss, stats = grpo_loss(garbage, old, advantages, mask, 0.2, 0.2)
    (grad,) = torch.autograd.grad(loss, garbage)
    assert torch.equal(loss, reference)
    assert torch.equal(grad, reference_grad)
    assert torch.equal(grad[mask == 0], torch.zeros(5))
    assert all(torch.isfinite(value) for value in stats.values())


def test_empty_responses() -> None:
    logprobs, old, mask = make_batch([[0.1, -0.1], []], length=3)
    loss, stats = grpo_loss(logprobs, old, torch.tensor([1.0, 3.0]), mask, 0.2, 0.2)
    # Only response 0 counts: (e^0.1 + e^-0.1) / 2 * A.
    close(loss, -(math.exp(0.1) + math.exp(-0.1)) / 2)
    close(stats["num_empty"], 1.0)

    empty = torch.randn(2, 3).requires_grad_(True)
    loss, stats = grpo_loss(empty, torch.randn(2, 3), torch.tensor([1.0, -1.0]), torch.zeros(2, 3), 0.2, 0.2)
    assert loss.requires_grad and loss.item() == 0.0
    loss.backward()
    assert torch.equal(empty.grad, torch.zeros(2, 3))
    close(stats["num_empty"], 2.0)
    assert all(torch.isfinite(value) for value in stats.values())


def naive_grpo_loss(logprobs: Tensor, old: Tensor, advantages: Tensor, mask: Tensor, eps_low: float,
                    eps_high: float) -> tuple[Tensor, int, int, int]:
    """Eq. 2 transcribed with loops; returns the loss and the tokens clipped low/high and in total."""
    total, count, clipped_low, clipped_high, tokens = logprobs.new_zeros(()), 0, 0, 0, 0
    for i in range(logprobs.shape[0]):
        positions = [t for t in range(logprobs.shape[1]) if mask[i, t] != 0]
        if not positions:
            continue
        response_total = logprobs.new_zeros(())
        for t in positions:
            w = torch.exp(logprobs[i, t] - old[i, t])
            clipped_w = max(1 - eps_low, min(w, 1 + eps_high))
            response_total = response_total + min(w * advantages[i], clipped_w * advantages[i])
            clipped_low += int(bool(advantages[i] < 0 and w < 1 - eps_low))
            clipped_high += int(bool(advantages[i] > 0 and w > 1 + eps_high))
        total = total + response_total / len(positions)
        count += 1
        tokens += len(positions)
    return -total / count, clipped_low, clipped_high, tokens


def test_matches_naive_transcription_of_eq_2() -> None:
    lengths = [6, 1, 0, 4, 2, 6, 3, 5, 1, 2]
    stats, low, high, tokens = compare_with_naive(grpo_loss, naive_grpo_loss, 2, lengths, 0.3, (0.2, 0.27))
    close(stats["clip_frac_low"], low / tokens)
    close(stats["clip_frac_high"], high / tokens)
    close(stats["num_empty"], 1.0)

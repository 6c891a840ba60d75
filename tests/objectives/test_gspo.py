from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from gspo_lightning.objectives import gspo_loss, sequence_log_ratio
from tests.objectives.helpers import close, compare_with_naive, make_batch


def loss_and_grad(
    logprobs: Tensor, old: Tensor, advantages: list[float], mask: Tensor
) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    loss, stats = gspo_loss(logprobs, old, torch.tensor(advantages), mask, eps_low=0.2, eps_high=0.2)
    (grad,) = torch.autograd.grad(loss, logprobs)
    return loss, stats, grad


def close_stats(stats: dict[str, Tensor], **expected: float) -> None:
    for name, value in expected.items():
        close(stats[name], value)


def test_unclipped_value_gradient_and_stats() -> None:
    logprobs, old, mask = make_batch([[0.1, -0.3], [0.2, 0.1, 0.0]], length=4)
    loss, stats, grad = loss_and_grad(logprobs, old, [1.0, -0.5], mask)
    # log s_0 = (0.1 - 0.3) / 2 = -0.1 -> s_0 = 0.904837; log s_1 = 0.3 / 3 = 0.1 -> s_1 = 1.105171: both in [0.8, 1.2]
    s0, s1 = math.exp(-0.1), math.exp(0.1)
    # J = (1.0 * s_0 + (-0.5) * s_1) / 2 = (0.904837 - 0.552585) / 2 = 0.176126; each response weighs 1/2.
    close(loss, -(s0 - 0.5 * s1) / 2)
    # Eq. 10: d(-J)/d logprob_i,t = -(1/N) * A_i * s_i / |y_i|: -s_0/4 on response 0, +0.5 * s_1 / 6 on response 1.
    expected = torch.tensor([[-s0 / 4, -s0 / 4, 0, 0], [s1 / 12, s1 / 12, s1 / 12, 0]])
    close(grad, expected)
    close_stats(stats, clip_frac=0.0, ratio_mean=(s0 + s1) / 2, ratio_min=s0, ratio_max=s1, num_empty=0.0)
    close_stats(stats, seq_log_ratio_abs_mean=0.1)  # (|-0.1| + |0.1|) / 2
    assert set(stats) == {"clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_min", "ratio_max",
                          "seq_log_ratio_abs_mean", "num_empty"}
    assert all(value.dim() == 0 and value.dtype == torch.float32 and not value.requires_grad
               for value in stats.values())


def test_clipped_high_and_low_remove_the_gradient() -> None:
    logprobs, old, mask = make_batch([[0.3, 0.3], [-0.3, -0.3, -0.3], [0.05]], length=3)
    loss, stats, grad = loss_and_grad(logprobs, old, [1.0, -1.0, 2.0], mask)
    # s_0 = e^0.3 = 1.3499 > 1.2 with A > 0 -> clipped high, objective 1.2 * 1 = 1.2
    # s_1 = e^-0.3 = 0.7408 < 0.8 with A < 0 -> clipped low, objective 0.8 * -1 = -0.8
    # s_2 = e^0.05 = 1.0513 in range -> objective 2 * 1.0513
    s2 = math.exp(0.05)
    close(loss, -(1.2 - 0.8 + 2 * s2) / 3)
    # Clipped responses get no gradient; response 2 gets -(1/3) * 2 * s_2 / 1.
    close(grad, torch.tensor([[0, 0, 0], [0, 0, 0], [-2 * s2 / 3, 0, 0]]))
    # Token-weighted: 2 of the 6 response tokens are clipped high, 3 clipped low.
    close_stats(stats, clip_frac_high=2 / 6, clip_frac_low=3 / 6, clip_frac=5 / 6)


def test_non_clipping_sides_keep_the_gradient() -> None:
    logprobs, old, mask = make_batch([[-0.3, -0.3], [0.3, 0.3, 0.3], [0.5]], length=3)
    loss, stats, grad = loss_and_grad(logprobs, old, [1.0, -1.0, 0.0], mask)
    # s_0 = e^-0.3 < 0.8 but A > 0: min(s A, 0.8 A) = s A, unclipped. s_1 = e^0.3 > 1.2 but A < 0: min = s A too.
    # Response 2 has A = 0 with s far out of range: objective 0, never counted as clipped.
    s_low, s_high = math.exp(-0.3), math.exp(0.3)
    close(loss, -(s_low - s_high + 0.0) / 3)
    # d(-J)/d logprob = -(1/3) * A * s / |y|: -s_low / 6 on response 0, +s_high / 9 on response 1.
    close(grad, torch.tensor([[-s_low / 6, -s_low / 6, 0], [s_high / 9] * 3, [0, 0, 0]]))
    close_stats(stats, clip_frac=0.0, clip_frac_low=0.0, clip_frac_high=0.0)


def test_padding_contributes_nothing_even_when_non_finite() -> None:
    logprobs, old, mask = make_batch([[0.1, -0.3], [0.2, 0.1, 0.0]], length=5)
    reference, _, reference_grad = loss_and_grad(logprobs, old, [1.0, -0.5], mask)
    garbage, old_garbage = logprobs.detach().clone(), old.clone()
    garbage[0, 2:] = torch.tensor([float("nan"), float("inf"), -1e30])
    garbage[1, 3:] = torch.tensor([1e30, float("-inf")])
    old_garbage[0, 2], old_garbage[1, 4] = float("nan"), float("inf")
    garbage.requires_grad_(True)
    loss, stats, grad = loss_and_grad(garbage, old_garbage, [1.0, -0.5], mask)
    assert torch.equal(loss, reference) and torch.equal(grad, reference_grad)
    assert torch.equal(grad[mask == 0], torch.zeros(5))
    assert all(torch.isfinite(value) for value in stats.values())


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.float32])
def test_mask_dtype_does_not_matter(dtype: torch.dtype) -> None:
    logprobs, old, mask = make_batch([[0.1, -0.3], [0.2, 0.1, 0.0]], length=4)
    reference, _, _ = loss_and_grad(logprobs, old, [1.0, -0.5], mask)
    loss, _, _ = loss_and_grad(logprobs, old, [1.0, -0.5], mask.to(dtype))
    assert torch.equal(loss, reference)


def test_each_response_weighs_the_same_whatever_its_length() -> None:
    # The same per-token log-ratio 0.1 over 2 and over 5 tokens: s = e^0.1 for both (Eq. 7 normalises by length).
    for log_ratios in ([[0.1, 0.1]], [[0.1] * 5]):
        logprobs, old, mask = make_batch(log_ratios, length=5)
        close(loss_and_grad(logprobs, old, [1.0], mask)[0], -math.exp(0.1))
    # Together with a different advantage, each still weighs 1/2 (a token mean would weigh them 2/7 and 5/7).
    both, old_both, mask_both = make_batch([[0.1, 0.1], [0.1] * 5], length=5)
    loss_both, _, _ = loss_and_grad(both, old_both, [1.0, -3.0], mask_both)
    close(loss_both, -(math.exp(0.1) - 3 * math.exp(0.1)) / 2)


def test_ratio_one_gives_reinforce_with_group_baseline_gradient() -> None:
    torch.manual_seed(0)
    lengths = [5, 3, 1, 4, 2, 5]
    mask = (torch.arange(5)[None, :] < torch.tensor(lengths)[:, None]).float()  # [6, 5]
    logprobs = torch.randn(6, 5).requires_grad_(True)
    advantages = torch.randn(6)
    loss, stats = gspo_loss(logprobs, logprobs.detach(), advantages, mask, 3e-4, 4e-4)
    (grad,) = torch.autograd.grad(loss, logprobs)
    # s_i = 1 everywhere: -J = -mean(A), and d(-J)/d logprob_i,t = -A_i / (N |y_i|) on response tokens.
    close(loss, -advantages.mean())
    close(grad, -advantages[:, None] / (6 * torch.tensor(lengths, dtype=torch.float32)[:, None]) * mask)
    close_stats(stats, clip_frac=0.0, ratio_mean=1.0)


def test_empty_response_is_excluded_and_counted() -> None:
    logprobs, old, mask = make_batch([[0.1, -0.3], [], [0.2, 0.1, 0.0]], length=4)
    loss, stats, grad = loss_and_grad(logprobs, old, [1.0, 5.0, -0.5], mask)
    # Same as the unclipped case without the empty row: it weighs nothing, N_valid = 2.
    close(loss, -(math.exp(-0.1) - 0.5 * math.exp(0.1)) / 2)
    close_stats(stats, num_empty=1.0, ratio_min=math.exp(-0.1), seq_log_ratio_abs_mean=0.1)
    assert torch.equal(grad[1], torch.zeros(4))
    # (0.1 - 0.3) / 2 = -0.1; empty -> 0; (0.2 + 0.1 + 0.0) / 3 = 0.1
    close(sequence_log_ratio(logprobs, old, mask), torch.tensor([-0.1, 0.0, 0.1]))


def test_all_empty_batch_gives_zero_loss_and_zero_gradients() -> None:
    logprobs = torch.randn(3, 4).requires_grad_(True)
    loss, stats = gspo_loss(logprobs, torch.randn(3, 4), torch.tensor([1.0, -1.0, 0.5]), torch.zeros(3, 4), 0.2, 0.2)
    assert loss.requires_grad and loss.item() == 0.0
    loss.backward()
    assert torch.equal(logprobs.grad, torch.zeros(3, 4))
    close_stats(stats, num_empty=3.0, clip_frac=0.0, ratio_mean=1.0)
    assert all(torch.isfinite(value) for value in stats.values())


def test_low_precision_logprobs_give_a_float32_loss() -> None:
    logprobs, old, mask = make_batch([[0.125, -0.25], [0.5, 0.0, 0.25]], length=4)
    half = logprobs.detach().bfloat16().requires_grad_(True)
    loss, _ = gspo_loss(half, old.bfloat16(), torch.tensor([1.0, -0.5]), mask, 0.2, 0.2)
    assert loss.dtype == torch.float32
    loss.backward()
    assert half.grad.dtype == torch.bfloat16 and torch.isfinite(half.grad).all()


def naive_gspo_loss(logprobs: Tensor, old: Tensor, advantages: Tensor, mask: Tensor, eps_low: float,
                    eps_high: float) -> tuple[Tensor, int, int, int]:
    """Eqs. 5 and 7 transcribed with loops; returns the loss and the tokens clipped low/high and in total."""
    total, count, clipped_low, clipped_high, tokens = logprobs.new_zeros(()), 0, 0, 0, 0
    for i in range(logprobs.shape[0]):
        positions = [t for t in range(logprobs.shape[1]) if mask[i, t] != 0]
        if not positions:
            continue
        log_s = sum(logprobs[i, t] - old[i, t] for t in positions) / len(positions)
        s = torch.exp(log_s)
        clipped_s = max(1 - eps_low, min(s, 1 + eps_high))
        total = total + min(s * advantages[i], clipped_s * advantages[i])
        count, tokens = count + 1, tokens + len(positions)
        clipped_low += len(positions) if advantages[i] < 0 and s < 1 - eps_low else 0
        clipped_high += len(positions) if advantages[i] > 0 and s > 1 + eps_high else 0
    return -total / count, clipped_low, clipped_high, tokens


def test_matches_naive_transcription_of_eqs_5_and_7() -> None:
    lengths = [7, 1, 3, 0, 5, 2, 7, 4, 6, 1, 3, 5]
    stats, low, high, tokens = compare_with_naive(gspo_loss, naive_gspo_loss, 1, lengths, 0.05, (0.01, 0.012))
    close_stats(stats, clip_frac_low=low / tokens, clip_frac_high=high / tokens, num_empty=1.0)

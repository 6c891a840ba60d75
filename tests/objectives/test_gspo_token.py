from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from gspo_lightning.objectives import gspo_loss, gspo_token_log_ratio, gspo_token_loss, sequence_log_ratio
from tests.objectives.helpers import close, compare_with_naive, make_batch, naive_clip_term, random_batch

LENGTHS = [7, 1, 3, 0, 5, 2, 7, 4, 6, 1, 3, 5]


def naive_gspo_token_loss(logprobs: Tensor, old: Tensor, advantages: Tensor, mask: Tensor, eps_low: float,
                          eps_high: float) -> tuple[Tensor, int, int, int]:
    """Eqs. 13-17 with loops: s_i,t = sg[s_i] * pi(y_i,t) / sg[pi(y_i,t)], s_i over the whole response."""
    total, count, clipped_low, clipped_high, tokens = logprobs.new_zeros(()), 0, 0, 0, 0
    for i in range(logprobs.shape[0]):
        positions = [t for t in range(logprobs.shape[1]) if mask[i, t] != 0]
        if not positions:
            continue
        s = torch.exp(sum(logprobs[i, t] - old[i, t] for t in positions) / len(positions)).detach()
        response_total = logprobs.new_zeros(())
        for t in positions:
            s_t = s * torch.exp(logprobs[i, t]) / torch.exp(logprobs[i, t]).detach()
            advantage = advantages[i, t] if advantages.dim() == 2 else advantages[i]
            term, low, high = naive_clip_term(s_t, advantage, eps_low, eps_high)
            response_total, clipped_low, clipped_high = response_total + term, clipped_low + low, clipped_high + high
        total, count, tokens = total + response_total / len(positions), count + 1, tokens + len(positions)
    return -total / count, clipped_low, clipped_high, tokens


@pytest.mark.parametrize("per_token", [False, True])
def test_matches_naive_transcription_of_eqs_13_to_17(per_token: bool) -> None:
    stats, low, high, tokens = compare_with_naive(
        gspo_token_loss, naive_gspo_token_loss, 1, LENGTHS, 0.05, (0.01, 0.012), per_token_advantages=per_token
    )
    close(stats["clip_frac_low"], low / tokens)
    close(stats["clip_frac_high"], high / tokens)
    close(stats["num_empty"], 1.0)


@pytest.mark.parametrize("as_token_matrix", [False, True])
def test_equals_gspo_with_per_response_advantages(as_token_matrix: bool) -> None:
    logprobs, old, advantages, mask = random_batch(1, LENGTHS, 0.05)
    token_advantages = advantages[:, None].expand(mask.shape) if as_token_matrix else advantages  # [N, T] or [N]
    loss, stats = gspo_token_loss(logprobs, old, token_advantages, mask, 0.01, 0.012)
    (grad,) = torch.autograd.grad(loss, logprobs)
    reference, reference_stats = gspo_loss(logprobs, old, advantages, mask, 0.01, 0.012)
    (reference_grad,) = torch.autograd.grad(reference, logprobs)
    assert reference_stats["clip_frac_low"] > 0 and reference_stats["clip_frac_high"] > 0
    close(loss, reference)
    close(grad, reference_grad)
    assert stats.keys() == reference_stats.keys()
    for name, value in stats.items():
        close(value, reference_stats[name])


def test_per_token_advantages_change_the_gradient() -> None:
    # Unclipped (eps 0.5): J_i = 1/|y_i| sum_t s_i A_i,t = s_i * mean_t A_i,t, the value of GSPO with the mean
    # advantage; but token t's gradient is -s_i A_i,t / (N |y_i|) instead of GSPO's uniform -s_i mean(A) / (N |y_i|).
    logprobs, old, mask = make_batch([[0.1, -0.3, 0.05], [0.2, 0.1]], length=3)
    token_advantages = torch.tensor([[1.0, -2.0, 0.5], [0.3, 3.0, float("nan")]])  # [2, 3], NaN on padding
    loss, stats = gspo_token_loss(logprobs, old, token_advantages, mask, 0.5, 0.5)
    (grad,) = torch.autograd.grad(loss, logprobs)
    s0, s1 = math.exp(-0.05), math.exp(0.15)  # (0.1 - 0.3 + 0.05) / 3 and (0.2 + 0.1) / 2
    mean_advantages = torch.tensor([-0.5 / 3, 3.3 / 2])
    close(loss, -(s0 * mean_advantages[0] + s1 * mean_advantages[1]) / 2)
    close(grad, torch.tensor([[-s0 * 1.0 / 6, s0 * 2.0 / 6, -s0 * 0.5 / 6], [-s1 * 0.3 / 4, -s1 * 3.0 / 4, 0.0]]))
    close(stats["clip_frac"], 0.0)

    gspo, _ = gspo_loss(logprobs, old, mean_advantages, mask, 0.5, 0.5)
    (gspo_grad,) = torch.autograd.grad(gspo, logprobs)
    close(gspo, loss)
    assert not torch.allclose(grad, gspo_grad, atol=1e-3)


def test_clipping_is_decided_per_token_with_per_token_advantages() -> None:
    # s = e^0.3 = 1.35 > 1.2 for every token of the response: clipped where A_t > 0, unclipped where A_t < 0.
    logprobs, old, mask = make_batch([[0.3, 0.3, 0.3]], length=3)
    loss, stats = gspo_token_loss(logprobs, old, torch.tensor([[1.0, -1.0, 2.0]]), mask, 0.2, 0.2)
    (grad,) = torch.autograd.grad(loss, logprobs)
    s = math.exp(0.3)
    close(loss, -(1.2 - s + 2 * 1.2) / 3)
    close(grad, torch.tensor([[0.0, s / 3, 0.0]]))
    close(stats["clip_frac_high"], 2 / 3)
    close(stats["clip_frac_low"], 0.0)


def test_padding_contributes_nothing_even_when_non_finite() -> None:
    logprobs, old, mask = make_batch([[0.1, -0.3], [0.2, 0.1, 0.0]], length=5)
    advantages = torch.tensor([[1.0, -1.0, 0, 0, 0], [0.5, 2.0, -0.5, 0, 0]])
    reference, _ = gspo_token_loss(logprobs, old, advantages, mask, 0.2, 0.2)
    (reference_grad,) = torch.autograd.grad(reference, logprobs)
    garbage, old_garbage, advantages_garbage = logprobs.detach().clone(), old.clone(), advantages.clone()
    garbage[0, 2:] = torch.tensor([float("nan"), float("inf"), -1e30])
    old_garbage[1, 3:] = torch.tensor([float("-inf"), float("nan")])
    advantages_garbage[0, 2:] = torch.tensor([float("nan"), float("inf"), -1e30])
    garbage.requires_grad_(True)
    loss, stats = gspo_token_loss(garbage, old_garbage, advantages_garbage, mask, 0.2, 0.2)
    (grad,) = torch.autograd.grad(loss, garbage)
    assert torch.equal(loss, reference) and torch.equal(grad, reference_grad)
    assert torch.equal(grad[mask == 0], torch.zeros(5))
    assert all(torch.isfinite(value) for value in stats.values())


def test_token_log_ratio_is_the_sequence_log_ratio_with_a_per_token_gradient() -> None:
    logprobs, old, mask = make_batch([[0.1, -0.3], [0.2, 0.1, 0.0], []], length=4)
    token_log_ratio = gspo_token_log_ratio(logprobs, old, mask)  # [3, 4]
    expected = sequence_log_ratio(logprobs, old, mask)[:, None].expand(3, 4)  # [3, 4]
    assert torch.equal(token_log_ratio.detach(), expected.detach())
    weights = torch.arange(12.0).reshape(3, 4)
    (grad,) = torch.autograd.grad((token_log_ratio * weights).sum(), logprobs)
    assert torch.equal(grad, weights * mask)


def test_advantage_shape_is_validated() -> None:
    logprobs, old, mask = make_batch([[0.1], [0.2]], length=2)
    with pytest.raises(ValueError, match=r"advantages must be \[N\] = \(2,\) .* or \[N, T\] = \(2, 2\)"):
        gspo_token_loss(logprobs, old, torch.zeros(2, 3), mask, 0.2, 0.2)

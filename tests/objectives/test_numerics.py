"""Checks shared by every objective: ratio 1 (REINFORCE), extreme ratios, empty batches, low precision."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from torch import Tensor

from gspo_lightning.objectives import (
    MAX_EXP_LOG_RATIO,
    dr_grpo_loss,
    exp_with_linear_tail,
    grpo_loss,
    grpo_token_mean_loss,
    gspo_loss,
    gspo_token_loss,
)
from tests.objectives.helpers import close, make_batch

LOSSES = {
    "gspo": gspo_loss,
    "gspo_token": gspo_token_loss,
    "grpo": grpo_loss,
    "dapo": grpo_token_mean_loss,
    "dr_grpo": dr_grpo_loss,
    "dr_grpo_max_tokens_9": partial(dr_grpo_loss, max_tokens=9),
}
SEQUENCE_LEVEL = {"gspo", "gspo_token"}
LENGTHS = [5, 3, 0, 1, 4, 2, 5]


def reinforce_weights(name: str, lengths: Tensor, n: int, length: int) -> Tensor:
    """The 1/weight of A_i in d(-J)/d logprob_i,t at ratio 1: per response for Eqs. 2/5/13, else constant."""
    valid = lengths > 0
    return {
        "dapo": lengths.sum().expand(n),  # total response tokens
        "dr_grpo": torch.full((n,), float(n * length)),  # N * T (N counts the empty row)
        "dr_grpo_max_tokens_9": torch.full((n,), float(n * 9)),
    }.get(name, valid.sum() * lengths.clamp(min=1))  # N_valid * |y_i|


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_ratio_one_gives_reinforce_with_group_baseline_gradient(name: str) -> None:
    torch.manual_seed(0)
    n, length = len(LENGTHS), max(LENGTHS)
    lengths = torch.tensor(LENGTHS, dtype=torch.float32)
    mask = torch.arange(length)[None, :] < lengths[:, None]  # [N, T]
    logprobs = torch.randn(n, length).requires_grad_(True)
    advantages = torch.randn(n)
    loss, stats = LOSSES[name](logprobs, logprobs.detach().clone(), advantages, mask, 3e-4, 4e-4)
    (grad,) = torch.autograd.grad(loss, logprobs)
    # Every ratio is 1: -J = -sum_i weight_i * |y_i| * A_i, d(-J)/d logprob_i,t = -A_i * weight_i on response tokens.
    weights = 1.0 / reinforce_weights(name, lengths, n, length)  # [N]
    close(grad, torch.where(mask, -(advantages * weights)[:, None], torch.zeros(n, length)))
    close(loss, -(advantages * weights * lengths).sum())
    close(stats["clip_frac"], 0.0)
    close(stats["ratio_min"], 1.0)
    close(stats["num_empty"], 1.0)


def test_exp_with_linear_tail_is_exp_up_to_the_cap_and_its_tangent_beyond() -> None:
    log_ratio = torch.tensor([-1e4, -3.0, 0.0, 0.7, MAX_EXP_LOG_RATIO, 25.0, 1e4], requires_grad=True)
    ratio = exp_with_linear_tail(log_ratio)
    (grad,) = torch.autograd.grad(ratio.sum(), log_ratio)
    reference = log_ratio.detach()[:5].clone().requires_grad_(True)
    (reference_grad,) = torch.autograd.grad(reference.exp().sum(), reference)
    assert torch.equal(ratio[:5], reference.exp()) and torch.equal(grad[:5], reference_grad)
    cap = math.exp(MAX_EXP_LOG_RATIO)
    torch.testing.assert_close(ratio[5:], torch.tensor([cap * 6.0, cap * (1e4 - 19.0)]))
    torch.testing.assert_close(grad[5:], torch.tensor([cap, cap]))


def extreme_batch(log_ratio: float) -> tuple[Tensor, Tensor, Tensor]:
    """Response 0 has one token with the given log-ratio (and a NaN on padding); response 1 is ordinary."""
    logprobs, old, mask = make_batch([[0.0, log_ratio, 0.0], [0.05, -0.05]], length=4)
    garbage = logprobs.detach().clone()
    garbage[0, 3] = float("nan")
    return garbage.requires_grad_(True), old, mask


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("advantage", [1.0, 0.0, -1.0])
@pytest.mark.parametrize("log_ratio", [1e4, -1e4])
def test_extreme_ratio_gives_finite_loss_and_gradient(name: str, advantage: float, log_ratio: float) -> None:
    logprobs, old, mask = extreme_batch(log_ratio)
    loss, stats = LOSSES[name](logprobs, old, torch.tensor([advantage, 0.5]), mask, 0.2, 0.2)
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(torch.isfinite(value) for value in stats.values())
    assert grad[0, 3] == 0.0
    # Which tokens of response 0 have the extreme ratio: all of them for s_i (1e4 / 3), else only token 1.
    extreme = [0, 1, 2] if name in SEQUENCE_LEVEL else [1]
    if advantage > 0 and log_ratio > 0:  # clipped high: exactly no gradient, as with an exact exp
        assert torch.equal(grad[0, extreme], torch.zeros(len(extreme)))
    if advantage == 0:
        assert torch.equal(grad[0], torch.zeros(4))
    if advantage < 0 and log_ratio > 0:  # unclipped: the gradient pushes the likelihood down, capped at e^20
        assert (grad[0, extreme] > 1e6).all()
    if advantage < 0 and log_ratio < 0:  # clipped low
        assert torch.equal(grad[0, extreme], torch.zeros(len(extreme)))


def test_extreme_sequence_ratio_with_negative_advantage_keeps_a_capped_gradient() -> None:
    # log s_0 = 1e4 / 3 > 20: s_0 = e^20 (1 + log s_0 - 20); d(-J)/d logprob_0,t = -A e^20 / (N |y_0|) = e^20 / 6.
    logprobs, old, mask = extreme_batch(1e4)
    for loss_fn in (gspo_loss, gspo_token_loss):
        loss, _ = loss_fn(logprobs, old, torch.tensor([-1.0, 0.0]), mask, 0.2, 0.2)
        (grad,) = torch.autograd.grad(loss, logprobs)
        cap = math.exp(MAX_EXP_LOG_RATIO)
        torch.testing.assert_close(loss, torch.tensor(cap * (1 + 1e4 / 3 - 20) / 2))
        torch.testing.assert_close(grad[0], torch.tensor([cap / 6] * 3 + [0.0]))


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("rows", [0, 3])
def test_batch_without_response_tokens_gives_zero_loss_and_zero_gradients(name: str, rows: int) -> None:
    logprobs = torch.randn(rows, 4).requires_grad_(True)
    loss, stats = LOSSES[name](logprobs, torch.randn(rows, 4), torch.randn(rows), torch.zeros(rows, 4), 0.2, 0.2)
    assert loss.requires_grad and loss.item() == 0.0
    loss.backward()
    assert torch.equal(logprobs.grad, torch.zeros(rows, 4))
    close(stats["num_empty"], float(rows))
    assert all(torch.isfinite(value) for value in stats.values())


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_low_precision_logprobs_give_a_float32_loss(name: str) -> None:
    logprobs, old, mask = make_batch([[0.125, -0.25], [0.5, 0.0, 0.25]], length=4)
    half = logprobs.detach().bfloat16().requires_grad_(True)
    loss, _ = LOSSES[name](half, old.bfloat16(), torch.tensor([1.0, -0.5]), mask.int(), 0.2, 0.2)
    assert loss.dtype == torch.float32
    loss.backward()
    assert half.grad.dtype == torch.bfloat16 and torch.isfinite(half.grad).all()

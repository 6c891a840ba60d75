from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import Tensor

from gspo_lightning.objectives import (
    OBJECTIVE_PRESETS,
    KLRewardPenalty,
    aggregate_constant,
    aggregate_sequence_mean,
    aggregate_token_mean,
    kl_penalty,
    kl_reward_penalty,
    objective_loss,
    reward_kl_penalty,
)
from gspo_lightning.objectives.kl import kl_penalised_rewards
from tests.objectives.helpers import close, random_batch

LOG_HALF, LOG_QUARTER = math.log(0.5), math.log(0.25)


def hand_batch() -> tuple[Tensor, Tensor, Tensor]:
    """Token 0: pi = 0.5, pi_ref = 0.25; token 1: pi = 0.25, pi_ref = 0.5; token 2: padding holding NaN/inf."""
    logprobs = torch.tensor([[LOG_HALF, LOG_QUARTER, float("nan")]], requires_grad=True)
    ref = torch.tensor([[LOG_QUARTER, LOG_HALF, float("inf")]])
    return logprobs, ref, torch.tensor([[1, 1, 0]])


def test_k1_hand_values_and_gradient() -> None:
    logprobs, ref, mask = hand_batch()
    kl = kl_penalty(logprobs, ref, mask, "k1")
    # k1 = log pi - log pi_ref: log 2 and -log 2; exactly 0 on padding. d k1 / d log pi = 1.
    close(kl, torch.tensor([[math.log(2), -math.log(2), 0.0]]))
    (grad,) = torch.autograd.grad(kl.sum(), logprobs)
    assert torch.equal(grad, torch.tensor([[1.0, 1.0, 0.0]]))


def test_k2_hand_values_and_gradient() -> None:
    logprobs, ref, mask = hand_batch()
    kl = kl_penalty(logprobs, ref, mask, "k2")
    # k2 = (log pi - log pi_ref)^2 / 2 = (log 2)^2 / 2 for both tokens; d k2 / d log pi = log r = +-log 2.
    close(kl, torch.tensor([[0.5 * math.log(2) ** 2, 0.5 * math.log(2) ** 2, 0.0]]))
    (grad,) = torch.autograd.grad(kl.sum(), logprobs)
    close(grad, torch.tensor([[math.log(2), -math.log(2), 0.0]]))


def test_k3_hand_values_and_gradient() -> None:
    logprobs, ref, mask = hand_batch()
    kl = kl_penalty(logprobs, ref, mask, "k3")
    # d = log pi_ref - log pi: -log 2 -> 0.5 + log 2 - 1 = 0.193147; +log 2 -> 2 - log 2 - 1 = 0.306853.
    close(kl, torch.tensor([[0.5 + math.log(2) - 1, 1 - math.log(2), 0.0]]))
    # d k3 / d log pi = 1 - exp(d): 1 - 0.5 and 1 - 2.
    (grad,) = torch.autograd.grad(kl.sum(), logprobs)
    close(grad, torch.tensor([[0.5, -1.0, 0.0]]))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_zero_on_padding_even_with_non_finite_values_and_float32(estimator: str) -> None:
    logprobs, old, _, mask = random_batch(3, [5, 0, 3, 1], 0.5)
    ref = torch.where(mask, old, torch.full_like(old, float("nan")))  # NaN on padding
    garbage = torch.where(mask, logprobs.detach(), torch.full_like(old, float("-inf"))).bfloat16()
    garbage.requires_grad_(True)
    kl = kl_penalty(garbage, ref.bfloat16(), mask, estimator)
    assert kl.dtype == torch.float32
    assert torch.equal(kl[~mask], torch.zeros(int((~mask).sum())))
    assert torch.isfinite(kl).all()
    (grad,) = torch.autograd.grad(kl.sum(), garbage)
    assert torch.isfinite(grad.float()).all() and torch.equal(grad[~mask].float(), torch.zeros(int((~mask).sum())))


def test_k3_is_never_negative() -> None:
    torch.manual_seed(4)
    logprobs = torch.cat([torch.randn(4096) * 3, torch.randn(4096) * 1e-4, torch.tensor([0.0])]).reshape(1, -1)
    kl = kl_penalty(logprobs, torch.zeros_like(logprobs), torch.ones_like(logprobs), "k3")
    assert (kl >= 0).all()
    assert (kl_penalty(logprobs, torch.zeros_like(logprobs), torch.ones_like(logprobs), "k1") < 0).any()


def test_k3_stays_finite_for_an_extreme_log_ratio() -> None:
    # d = log pi_ref - log pi = 1e4: exp(d) overflows; above d = 20 k3 follows its tangent, finite and > 0,
    # with the gradient d k3 / d log pi = -(e^20 - 1) kept (not dropped).
    logprobs = torch.tensor([[-1e4, 0.0]], requires_grad=True)
    kl = kl_penalty(logprobs, torch.zeros(1, 2), torch.ones(1, 2), "k3")
    (grad,) = torch.autograd.grad(kl.sum(), logprobs)
    assert torch.isfinite(kl).all() and kl[0, 0] > 0
    close(kl[0, 0] / 1e12, (math.expm1(20) - 20 + math.expm1(20) * (1e4 - 20)) / 1e12)
    close(grad, torch.tensor([[-math.expm1(20), 0.0]]))


def test_unknown_estimator_and_shapes_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"estimator must be one of k1, k2, k3, got estimator='k4'"):
        kl_penalty(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), "k4")
    with pytest.raises(ValueError, match=r"must all be \[N, T\]"):
        kl_penalty(torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2), "k1")


def naive_sequence_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Per-response token mean, then mean over responses with tokens (loops, float64)."""
    means = [values[i][mask[i]].double().sum() / int(mask[i].sum()) for i in range(len(values)) if mask[i].any()]
    return sum(means) / len(means)


@pytest.mark.parametrize("preset", sorted(OBJECTIVE_PRESETS))
@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_objective_loss_adds_exactly_kl_coef_times_the_aggregated_kl(preset: str, estimator: str) -> None:
    logprobs, old, advantages, mask = random_batch(5, [6, 1, 0, 4, 2, 6], 0.3)
    ref = torch.where(mask, old + 0.5 * torch.randn(old.shape), torch.full_like(old, float("nan")))  # [N, T]
    base_spec = replace(OBJECTIVE_PRESETS[preset], kl_estimator=estimator)
    spec = replace(base_spec, kl_coef=0.05)
    loss, stats = objective_loss(spec, logprobs, old, advantages, mask, 0.2, 0.27, ref_logprobs=ref)
    (grad,) = torch.autograd.grad(loss, logprobs)
    base, base_stats = objective_loss(base_spec, logprobs, old, advantages, mask, 0.2, 0.27)
    (base_grad,) = torch.autograd.grad(base, logprobs)
    aggregate = {"sequence_mean": aggregate_sequence_mean, "token_mean": aggregate_token_mean,
                 "constant": aggregate_constant}[spec.objective.aggregation]
    kl = aggregate(kl_penalty(logprobs, ref, mask, estimator), mask)
    (kl_grad,) = torch.autograd.grad(kl, logprobs)

    assert torch.equal(loss, base + 0.05 * kl)
    close(grad, base_grad + 0.05 * kl_grad)
    assert torch.equal(stats["kl"], kl.detach()) and "kl" not in base_stats
    assert all(torch.equal(value, stats[name]) for name, value in base_stats.items())
    assert torch.isfinite(grad).all() and torch.equal(grad[~mask], torch.zeros(int((~mask).sum())))
    if spec.objective.aggregation == "sequence_mean":
        close(kl, naive_sequence_mean(kl_penalty(logprobs, ref, mask, estimator), mask).float())


def test_kl_is_reported_but_not_added_when_kl_coef_is_zero() -> None:
    logprobs, old, advantages, mask = random_batch(5, [3, 2], 0.3)
    spec = OBJECTIVE_PRESETS["gspo"]
    with_ref, stats = objective_loss(spec, logprobs, old, advantages, mask, 0.2, 0.2, ref_logprobs=old - 0.1)
    without_ref, _ = objective_loss(spec, logprobs, old, advantages, mask, 0.2, 0.2)
    assert torch.equal(with_ref, without_ref)
    expected = naive_sequence_mean(kl_penalty(logprobs, old - 0.1, mask, "k3"), mask).float()
    close(stats["kl"], expected)


def test_missing_reference_with_positive_kl_coef_is_rejected() -> None:
    logprobs, old, advantages, mask = random_batch(5, [3, 2], 0.3)
    spec = replace(OBJECTIVE_PRESETS["gspo"], kl_coef=0.1)
    with pytest.raises(ValueError, match=r"kl_coef=0.1 > 0 needs ref_logprobs"):
        objective_loss(spec, logprobs, old, advantages, mask, 0.2, 0.2)


def test_a_reward_placed_kl_is_reported_but_never_added_to_the_loss() -> None:
    logprobs, old, advantages, mask = random_batch(5, [3, 2], 0.3)
    spec = replace(OBJECTIVE_PRESETS["gspo"], kl_coef=0.5, kl_estimator="k1", kl_in="reward")
    with_ref, stats = objective_loss(spec, logprobs, old, advantages, mask, 0.2, 0.2, ref_logprobs=old - 0.1)
    without, _ = objective_loss(OBJECTIVE_PRESETS["gspo"], logprobs, old, advantages, mask, 0.2, 0.2)
    assert torch.equal(with_ref, without) and "kl" in stats
    assert reward_kl_penalty(spec) == KLRewardPenalty(0.5, "k1") and reward_kl_penalty(OBJECTIVE_PRESETS["gspo"]) is None


# ---- expected gradients, enumerated exactly over a small vocabulary --------------------------------------------

VOCAB = 6


def _policy_and_reference() -> tuple[Tensor, Tensor]:
    """Logits theta of pi_theta (float64, differentiable) and a fixed reference distribution, log-probs [V]."""
    generator = torch.Generator().manual_seed(3)
    theta = torch.randn(VOCAB, generator=generator, dtype=torch.float64).requires_grad_()
    ref = torch.log_softmax(torch.randn(VOCAB, generator=generator, dtype=torch.float64), -1)
    return theta, ref


def _expected_loss_gradient(estimator: str) -> tuple[Tensor, Tensor, Tensor]:
    """E_{y ~ pi_theta}[grad_theta k(y)] for a one-token response, summed exactly over the V tokens."""
    theta, ref = _policy_and_reference()
    logprobs = torch.log_softmax(theta, -1)  # [V]
    per_token = kl_penalty(logprobs[:, None], ref[:, None], torch.ones(VOCAB, 1), estimator)[:, 0]  # [V]: y = each
    weights = logprobs.exp().detach().float()  # [V] pi_theta(y): the sampling distribution, not differentiated
    (expected,) = torch.autograd.grad((weights * per_token).sum(), theta)
    return expected.double(), theta, ref


def _divergence_gradient(theta: Tensor, ref: Tensor, reverse: bool) -> Tensor:
    """The exact gradient of KL(pi_theta || pi_ref), or of KL(pi_ref || pi_theta) when ``reverse``."""
    logprobs = torch.log_softmax(theta, -1)
    kl = (ref.exp() * (ref - logprobs)).sum() if reverse else (logprobs.exp() * (logprobs - ref)).sum()
    return torch.autograd.grad(kl, theta)[0]


def test_k1_as_a_loss_term_has_zero_expected_gradient() -> None:
    expected, _, _ = _expected_loss_gradient("k1")
    torch.testing.assert_close(expected, torch.zeros(VOCAB, dtype=torch.float64), rtol=0, atol=1e-7)


def test_k2_as_a_loss_term_follows_the_gradient_of_kl_policy_to_reference() -> None:
    expected, theta, ref = _expected_loss_gradient("k2")
    forward = _divergence_gradient(theta, ref, reverse=False)
    torch.testing.assert_close(expected, forward, rtol=1e-5, atol=1e-7)
    assert (forward - _divergence_gradient(theta, ref, reverse=True)).abs().max() > 1e-2  # the two differ here


def test_k3_as_a_loss_term_follows_the_gradient_of_kl_reference_to_policy() -> None:
    expected, theta, ref = _expected_loss_gradient("k3")
    torch.testing.assert_close(expected, _divergence_gradient(theta, ref, reverse=True), rtol=1e-5, atol=1e-7)


def test_k1_as_a_reward_penalty_pulls_towards_the_reference() -> None:
    """Subtracted from the reward, -beta * k1(y) enters the score-function gradient E[R(y) grad log pi(y)]."""
    theta, ref = _policy_and_reference()
    logprobs = torch.log_softmax(theta, -1)  # [V]
    beta = 0.3
    kl = kl_reward_penalty(logprobs.detach()[:, None], ref[:, None], torch.ones(VOCAB, 1), "k1")  # [V]
    rewards, _ = kl_penalised_rewards(torch.zeros(VOCAB), logprobs.detach()[:, None], ref[:, None],
                                      torch.ones(VOCAB, 1), KLRewardPenalty(beta, "k1"))  # fmt: skip
    torch.testing.assert_close(rewards.double(), -beta * kl.double())
    weights = logprobs.exp().detach()  # [V]
    (expected,) = torch.autograd.grad((weights * rewards.double() * logprobs).sum(), theta)  # REINFORCE
    torch.testing.assert_close(expected, -beta * _divergence_gradient(theta, ref, reverse=False), rtol=1e-5, atol=1e-7)

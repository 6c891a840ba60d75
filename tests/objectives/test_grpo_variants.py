from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from torch import Tensor

from gspo_lightning.objectives import dr_grpo_loss, grpo_loss, grpo_token_mean_loss
from tests.objectives.helpers import close, compare_with_naive, make_batch, naive_clip_term, random_batch

LENGTHS = [6, 1, 0, 4, 2, 6, 3, 5, 1, 2]


def naive_token_terms(logprobs: Tensor, old: Tensor, advantages: Tensor, mask: Tensor, eps_low: float,
                      eps_high: float) -> tuple[list[list[Tensor]], int, int]:
    """GRPO's per-token terms min(w_i,t A_i, clip(w_i,t) A_i) of each response (Eq. 2), and the clip counts."""
    responses, clipped_low, clipped_high = [], 0, 0
    for i in range(logprobs.shape[0]):
        terms = []
        for t in range(logprobs.shape[1]):
            if mask[i, t] != 0:
                term, low, high = naive_clip_term(torch.exp(logprobs[i, t] - old[i, t]), advantages[i], eps_low,
                                                  eps_high)
                terms, clipped_low, clipped_high = terms + [term], clipped_low + low, clipped_high + high
        responses.append(terms)
    return responses, clipped_low, clipped_high


def naive_dapo_loss(*args) -> tuple[Tensor, int, int, int]:
    """DAPO: -sum_i sum_t term_i,t / sum_i |y_i|."""
    responses, low, high = naive_token_terms(*args)
    tokens = sum(len(terms) for terms in responses)
    return -sum(sum(terms) for terms in responses if terms) / tokens, low, high, tokens


def naive_dr_grpo_loss(*args, max_tokens: int | None = None) -> tuple[Tensor, int, int, int]:
    """Dr. GRPO: -sum_i sum_t term_i,t / (N * max_tokens), max_tokens = T by default."""
    responses, low, high = naive_token_terms(*args)
    budget = args[0].shape[1] if max_tokens is None else max_tokens
    total = sum(sum(terms) for terms in responses if terms)
    return -total / (len(responses) * budget), low, high, sum(len(terms) for terms in responses)


@pytest.mark.parametrize(
    ("loss_fn", "naive_fn"),
    [
        (grpo_token_mean_loss, naive_dapo_loss),
        (dr_grpo_loss, naive_dr_grpo_loss),
        (partial(dr_grpo_loss, max_tokens=16), partial(naive_dr_grpo_loss, max_tokens=16)),
    ],
    ids=["dapo", "dr_grpo", "dr_grpo_max_tokens_16"],
)
def test_matches_naive_transcription(loss_fn, naive_fn) -> None:
    stats, low, high, tokens = compare_with_naive(loss_fn, naive_fn, 2, LENGTHS, 0.3, (0.2, 0.27))
    close(stats["clip_frac_low"], low / tokens)
    close(stats["clip_frac_high"], high / tokens)
    close(stats["num_empty"], 1.0)


@pytest.mark.parametrize("loss_fn", [grpo_token_mean_loss, dr_grpo_loss])
def test_stats_are_grpos(loss_fn) -> None:
    logprobs, old, advantages, mask = random_batch(2, LENGTHS, 0.3)
    _, stats = loss_fn(logprobs, old, advantages, mask, 0.2, 0.27)
    _, reference = grpo_loss(logprobs, old, advantages, mask, 0.2, 0.27)
    assert stats.keys() == reference.keys()
    assert all(torch.equal(value, reference[name]) for name, value in stats.items())


def test_the_aggregations_weigh_responses_differently() -> None:
    # Log-ratio 0.1 on every token of a 1-token and a 3-token response, A = 1 and -1, w = e^0.1 in the clip range.
    logprobs, old, mask = make_batch([[0.1], [0.1, 0.1, 0.1]], length=4)
    advantages = torch.tensor([1.0, -1.0])
    w = math.exp(0.1)
    # GRPO (Eq. 2): each response 1/2 -> (w - w) / 2 = 0.
    close(grpo_loss(logprobs, old, advantages, mask, 0.2, 0.2)[0], 0.0)
    # DAPO: each token 1/4 -> (w - 3w) / 4: the long response dominates.
    close(grpo_token_mean_loss(logprobs, old, advantages, mask, 0.2, 0.2)[0], -(w - 3 * w) / 4)
    # Dr. GRPO: sum over N * T = 2 * 4 -> (w - 3w) / 8; with max_tokens = 10: (w - 3w) / 20.
    close(dr_grpo_loss(logprobs, old, advantages, mask, 0.2, 0.2)[0], -(w - 3 * w) / 8)
    close(dr_grpo_loss(logprobs, old, advantages, mask, 0.2, 0.2, max_tokens=10)[0], -(w - 3 * w) / 20)


@pytest.mark.parametrize("loss_fn", [grpo_token_mean_loss, dr_grpo_loss])
def test_padding_contributes_nothing_even_when_non_finite(loss_fn) -> None:
    logprobs, old, mask = make_batch([[0.3, -0.3], [0.3, 0.15, -0.3]], length=5)
    advantages = torch.tensor([1.0, -0.5])
    reference, _ = loss_fn(logprobs, old, advantages, mask, 0.2, 0.2)
    (reference_grad,) = torch.autograd.grad(reference, logprobs)
    garbage, old_garbage = logprobs.detach().clone(), old.clone()
    garbage[0, 2:] = torch.tensor([float("nan"), float("inf"), 1e30])
    old_garbage[1, 3:] = torch.tensor([float("-inf"), float("nan")])
    garbage.requires_grad_(True)
    loss, stats = loss_fn(garbage, old_garbage, advantages, mask, 0.2, 0.2)
    (grad,) = torch.autograd.grad(loss, garbage)
    assert torch.equal(loss, reference) and torch.equal(grad, reference_grad)
    assert torch.equal(grad[mask == 0], torch.zeros(5))
    assert all(torch.isfinite(value) for value in stats.values())


@pytest.mark.parametrize("max_tokens", [0, -3])
def test_dr_grpo_max_tokens_must_be_positive(max_tokens: int) -> None:
    logprobs, old, mask = make_batch([[0.1]], length=2)
    with pytest.raises(ValueError, match=rf"max_tokens must be >= 1, got max_tokens={max_tokens}"):
        dr_grpo_loss(logprobs, old, torch.tensor([1.0]), mask, 0.2, 0.2, max_tokens=max_tokens)

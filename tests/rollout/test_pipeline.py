"""Prompts longer than the context: the pure length logic, and the context length's sources."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gspo_lightning.rollout.pipeline import context_length, fit_prompts_to_context

PAD = 0


def _left_padded(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(lengths)
    ids = torch.tensor([[PAD] * (width - n) + list(range(10, 10 + n)) for n in lengths])  # [P, Lp]
    mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])  # [P, Lp]
    return ids, mask


def test_prompts_that_fit_are_returned_unchanged():
    ids, mask = _left_padded([3, 5])
    out_ids, out_mask, cut = fit_prompts_to_context(ids, mask, max_new_tokens=5, context=10)
    assert out_ids is ids and out_mask is mask and cut.tolist() == [False, False]


def test_unknown_context_checks_nothing():
    ids, mask = _left_padded([300])
    assert fit_prompts_to_context(ids, mask, 5, None)[2].tolist() == [False]


def test_error_names_prompt_length_budget_context_and_setting():
    ids, mask = _left_padded([3, 8])
    message = (
        r"prompt 1 of the batch has 8 tokens; with max_new_tokens=5 it needs 13 > the policy's context length "
        r"10 .*sampler.prompt_overflow='error'.*'truncate' or 'skip' \(allowed: \['error', 'truncate', 'skip'\]\)"
    )
    with pytest.raises(ValueError, match=message):
        fit_prompts_to_context(ids, mask, max_new_tokens=5, context=10)


@pytest.mark.parametrize("overflow", ["truncate", "skip"])
def test_truncation_keeps_the_last_tokens_of_long_prompts_only(overflow):
    ids, mask = _left_padded([3, 8])
    out_ids, out_mask, cut = fit_prompts_to_context(ids, mask, max_new_tokens=5, context=10, overflow=overflow)
    assert cut.tolist() == [False, True]
    assert out_ids.tolist() == [[PAD, PAD, 10, 11, 12], [13, 14, 15, 16, 17]]  # left truncation: the end stays
    assert out_mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]


def test_a_response_budget_as_long_as_the_context_is_an_error_even_when_truncating():
    ids, mask = _left_padded([3])
    with pytest.raises(ValueError, match="lower max_new_tokens: no prompt token would fit"):
        fit_prompts_to_context(ids, mask, max_new_tokens=10, context=10, overflow="truncate")


def test_context_length_prefers_the_model_config_and_ignores_absurd_values():
    tokenizer = SimpleNamespace(model_max_length=2048)
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=512))
    assert context_length(model, tokenizer) == 512
    assert context_length(SimpleNamespace(config=SimpleNamespace()), tokenizer) == 2048
    assert context_length(SimpleNamespace(module=model), tokenizer) == 512  # a strategy's wrapper
    assert context_length(None, SimpleNamespace(model_max_length=int(1e30))) is None


def test_context_length_of_the_tiny_policy(policy, tokenizer):
    assert context_length(policy, tokenizer) == policy.config.max_position_embeddings

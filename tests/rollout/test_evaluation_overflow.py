"""Held-out evaluation applies the same prompt-length rule as the sampler (evaluation.prompt_overflow)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.plugins.precision import Precision

from gspo_lightning.rollout import PromptBatch
from gspo_lightning.sampling import HeldOutEvaluation


def _first_only(prompts, completions, **columns):
    return [1.0 if i == 0 else 0.0 for i in range(len(completions))]


def _evaluate(policy, tokenizer, overflow: str) -> float:
    batch = PromptBatch(["1+1=", "12345+67890="], {"answer": ["2", "80235"]})
    data = SimpleNamespace(heldout_dataloader=lambda: [batch])
    trainer = SimpleNamespace(
        strategy=None, world_size=1, precision_plugin=Precision(), datamodule=data, loggers=[], global_step=0
    )
    module = SimpleNamespace(policy=policy, tokenizer=tokenizer, device=torch.device("cpu"))
    context = policy.config.max_position_embeddings
    evaluation = HeldOutEvaluation(_first_only, max_new_tokens=context - 6, prompt_overflow=overflow)
    return evaluation.evaluate(trainer, module)


def test_truncated_prompts_count_and_skipped_ones_do_not(policy, tokenizer):
    assert _evaluate(policy, tokenizer, "truncate") == 0.5
    assert _evaluate(policy, tokenizer, "skip") == 1.0


def test_overlong_held_out_prompt_is_an_error_by_default(policy, tokenizer):
    with pytest.raises(ValueError, match=r"prompt 1 of the batch has 12 tokens.*evaluation.prompt_overflow='error'"):
        _evaluate(policy, tokenizer, "error")


def test_evaluation_prompt_overflow_is_validated():
    with pytest.raises(ValueError, match=r"evaluation.prompt_overflow must be one of \['error', 'truncate', 'skip'\]"):
        HeldOutEvaluation(_first_only, prompt_overflow="cut")

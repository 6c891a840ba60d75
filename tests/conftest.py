"""Shared fixtures: a tiny Qwen3 policy with the character tokenizer, built locally in a second."""

from __future__ import annotations

import pytest
import torch

from gspo_lightning.models import TinyQwen3

TINY = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)


@pytest.fixture
def tiny_loader() -> TinyQwen3:
    return TinyQwen3(**TINY)


@pytest.fixture
def tokenizer(tiny_loader):
    return tiny_loader.load_tokenizer()


@pytest.fixture
def policy(tiny_loader, tokenizer):
    torch.manual_seed(0)
    return tiny_loader.load_model(tokenizer)

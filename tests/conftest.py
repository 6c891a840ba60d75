"""Shared fixtures: a tiny Qwen3 policy with the character tokenizer, built locally in a second."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gspo_lightning.models import TinyQwen3
from gspo_lightning.models.char_tokenizer import ASCII_ALPHABET, SIMPLE_CHAT_TEMPLATE

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


@pytest.fixture(scope="module")
def float64_policy():
    """A tiny Qwen3 in float64 (sdpa attention), for exactness tests of layouts and heads."""
    loader = TinyQwen3(**TINY)
    torch.manual_seed(0)
    return loader.load_model(loader.load_tokenizer()).double()


@pytest.fixture(scope="session")
def tiny_pretrained_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3 and a character tokenizer with a chat template, saved with ``save_pretrained``: a stand-in
    for a hub checkpoint that ``Pretrained(name_or_path=...)`` loads without network."""
    loader = TinyQwen3(
        **TINY, max_position_embeddings=1024, alphabet=ASCII_ALPHABET, chat_template=SIMPLE_CHAT_TEMPLATE
    )
    tokenizer = loader.load_tokenizer()
    path = tmp_path_factory.mktemp("tiny_pretrained")
    loader.load_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path

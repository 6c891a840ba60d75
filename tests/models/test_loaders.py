"""Policy loaders: Pretrained from a local directory, prepare_tokenizer, TinyQwen3."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gspo_lightning.models import Pretrained, TinyQwen3, build_char_tokenizer, prepare_tokenizer

SMALL = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 64}


def test_tiny_qwen3_shape_and_special_ids() -> None:
    loader = TinyQwen3(**SMALL, max_position_embeddings=32)
    tokenizer = loader.load_tokenizer()
    model = loader.load_model(tokenizer)
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.num_hidden_layers == 2
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert (model.config.pad_token_id, model.config.eos_token_id) == (0, 1)
    assert model.generation_config.pad_token_id == 0
    assert model.dtype == torch.float32
    assert tokenizer.model_max_length == 32
    assert tokenizer.padding_side == "left"


def test_tiny_qwen3_deterministic_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first = TinyQwen3(**SMALL, seed=7)
    model_a = first.load_model(first.load_tokenizer())
    assert torch.equal(torch.rand(3), expected_next)  # the global stream did not move
    model_b = TinyQwen3(**SMALL, seed=7).load_model(first.load_tokenizer())
    model_c = TinyQwen3(**SMALL, seed=8).load_model(first.load_tokenizer())
    state_a, state_b, state_c = model_a.state_dict(), model_b.state_dict(), model_c.state_dict()
    assert all(torch.equal(state_a[key], state_b[key]) for key in state_a)
    assert not torch.equal(state_a["model.embed_tokens.weight"], state_c["model.embed_tokens.weight"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hidden_size": 30, "num_heads": 4}, "divisible by num_heads"),
        ({"num_heads": 4, "num_kv_heads": 3}, "divisible by num_kv_heads"),
        ({"num_layers": 0}, "num_layers must be >= 1"),
    ],
)
def test_tiny_qwen3_validation(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TinyQwen3(**kwargs)


def test_pretrained_loads_save_pretrained_directory(tmp_path: Path) -> None:
    tiny = TinyQwen3(**SMALL)
    tokenizer = tiny.load_tokenizer()
    model = tiny.load_model(tokenizer)
    model.config.pad_token_id = None  # the loader must fill it in from the tokenizer
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    loader = Pretrained(str(tmp_path), attn_implementation="eager")
    loaded_tokenizer = loader.load_tokenizer()
    loaded = loader.load_model(loaded_tokenizer)
    assert loaded_tokenizer.encode("12+3=") == tokenizer.encode("12+3=")
    assert loaded_tokenizer.padding_side == "left"
    assert loaded.config.pad_token_id == tokenizer.pad_token_id
    assert loaded.config._attn_implementation == "eager"
    assert loaded.dtype == torch.float32
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)


def test_pretrained_dtype(tmp_path: Path) -> None:
    tiny = TinyQwen3(**SMALL)
    tokenizer = tiny.load_tokenizer()
    tiny.load_model(tokenizer).save_pretrained(tmp_path)
    assert Pretrained(str(tmp_path), dtype="bfloat16").load_model(tokenizer).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        Pretrained(str(tmp_path), dtype="int8")  # type: ignore[arg-type]


def test_prepare_tokenizer_uses_eos_as_pad_with_warning() -> None:
    tokenizer = build_char_tokenizer()
    tokenizer.pad_token = None
    tokenizer.padding_side = "right"
    with pytest.warns(UserWarning, match="no pad token"):
        prepared = prepare_tokenizer(tokenizer)
    assert prepared is tokenizer
    assert tokenizer.pad_token == "<eos>"
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    assert tokenizer.padding_side == "left"


def test_prepare_tokenizer_without_pad_or_eos_fails() -> None:
    tokenizer = build_char_tokenizer()
    tokenizer.pad_token = None
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="neither a pad nor an eos"):
        prepare_tokenizer(tokenizer)

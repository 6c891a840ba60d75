"""The character tokenizer: round trips, special ids, left padding, save/load."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from gspo_lightning.models import DEFAULT_ALPHABET, build_char_tokenizer


def test_one_token_per_character_and_round_trip() -> None:
    tokenizer = build_char_tokenizer()
    text = "(12 + 345) * 6-7=89 0"
    ids = tokenizer.encode(text)
    assert len(ids) == len(text)  # no BOS, no EOS, no merges
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) == len(DEFAULT_ALPHABET) + 3


def test_special_token_ids() -> None:
    tokenizer = build_char_tokenizer()
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<pad>", 0)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<eos>", 1)
    assert (tokenizer.unk_token, tokenizer.unk_token_id) == ("<unk>", 2)
    assert tokenizer.bos_token is None
    assert tokenizer.encode("x") == [2]  # outside the alphabet


def test_decode_skips_pad_and_eos() -> None:
    tokenizer = build_char_tokenizer()
    ids = [0, 0] + tokenizer.encode("1+2=3") + [1, 0]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "1+2=3"
    assert tokenizer.decode(ids) == "<pad><pad>1+2=3<eos><pad>"


def test_left_padding() -> None:
    tokenizer = build_char_tokenizer()
    assert tokenizer.padding_side == "left"
    batch = tokenizer(["1", "123"], padding=True)
    assert batch["input_ids"][0][:2] == [0, 0]
    assert batch["attention_mask"] == [[0, 0, 1], [1, 1, 1]]


def test_custom_alphabet_and_validation() -> None:
    tokenizer = build_char_tokenizer("ab", model_max_length=16)
    assert tokenizer.encode("ba") == [4, 3]
    assert tokenizer.model_max_length == 16
    with pytest.raises(ValueError, match="repeated"):
        build_char_tokenizer("aab")
    with pytest.raises(ValueError, match="empty"):
        build_char_tokenizer("")


def test_save_and_auto_tokenizer_round_trip(tmp_path: Path) -> None:
    tokenizer = build_char_tokenizer(model_max_length=64)
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = " 9*(8-7) = 9 "
    assert loaded.encode(text) == tokenizer.encode(text)
    assert loaded.decode(loaded.encode(text)) == text
    assert loaded.get_vocab() == tokenizer.get_vocab()
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.unk_token_id) == (0, 1, 2)
    assert loaded.padding_side == "left"
    assert loaded.model_max_length == 64

"""Policy models and tokenizers: loaders chosen in YAML, a character tokenizer, the supervised warm start."""

from __future__ import annotations

from gspo_lightning.models.char_tokenizer import DEFAULT_ALPHABET, build_char_tokenizer
from gspo_lightning.models.countdown_warm_start import CountdownWarmStartedTinyQwen3
from gspo_lightning.models.loaders import PolicyLoader, Pretrained, TinyQwen3, prepare_tokenizer
from gspo_lightning.models.lora import LoRA
from gspo_lightning.models.moe import TinyQwen3Moe
from gspo_lightning.models.scratchpad_warm_start import ScratchpadWarmStartedTinyQwen3
from gspo_lightning.models.warm_start import WARM_START_VERSION, SupervisedWarmStart, WarmStartedTinyQwen3

__all__ = [
    "CountdownWarmStartedTinyQwen3",
    "SupervisedWarmStart",
    "DEFAULT_ALPHABET",
    "WARM_START_VERSION",
    "LoRA",
    "PolicyLoader",
    "ScratchpadWarmStartedTinyQwen3",
    "Pretrained",
    "TinyQwen3",
    "TinyQwen3Moe",
    "WarmStartedTinyQwen3",
    "build_char_tokenizer",
    "prepare_tokenizer",
]

"""Policy models and tokenizers: loaders chosen in YAML, a character tokenizer, the supervised warm start's recipe
(each task's warm-started loader sits next to its task, in ``gspo_lightning.data``)."""

from __future__ import annotations

import warnings
from typing import Any

from gspo_lightning.models.char_tokenizer import DEFAULT_ALPHABET, build_char_tokenizer
from gspo_lightning.models.loaders import PolicyLoader, Pretrained, TinyQwen3, prepare_tokenizer
from gspo_lightning.models.lora import LoRA
from gspo_lightning.models.moe import TinyQwen3Moe
from gspo_lightning.models.warm_start import WARM_START_VERSION, SupervisedWarmStart

__all__ = [
    "SupervisedWarmStart",
    "DEFAULT_ALPHABET",
    "WARM_START_VERSION",
    "LoRA",
    "PolicyLoader",
    "Pretrained",
    "TinyQwen3",
    "TinyQwen3Moe",
    "build_char_tokenizer",
    "prepare_tokenizer",
]

_MOVED_TO_DATA = ("WarmStartedTinyQwen3", "CountdownWarmStartedTinyQwen3", "ScratchpadWarmStartedTinyQwen3")


def __getattr__(name: str) -> Any:
    """The task warm starts' old class paths (``gspo_lightning.models.WarmStartedTinyQwen3``) keep working, with a
    warning naming the new one; imported on first use only, so ``models`` never needs ``data`` to load."""
    if name not in _MOVED_TO_DATA:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import gspo_lightning.data as data  # the one way back up, for old configs

    warnings.warn(
        f"gspo_lightning.models.{name} moved to gspo_lightning.data.{name}: update the class_path in your config",
        FutureWarning,
        stacklevel=2,
    )
    return getattr(data, name)

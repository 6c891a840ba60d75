"""How the policy and its tokenizer are built: small config classes chosen in YAML with ``class_path``.

``Pretrained`` loads a hub model or a local ``save_pretrained`` directory; ``TinyQwen3`` builds a randomly
initialised tiny model with the character tokenizer, for tests and the CPU quick start.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from gspo_lightning.models.char_tokenizer import CHAT_TEMPLATES, DEFAULT_ALPHABET, build_char_tokenizer
from gspo_lightning.validation import SettingError

_TINY_SETTINGS = (
    "hidden_size num_layers num_heads num_kv_heads intermediate_size max_position_embeddings alphabet seed".split()
)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Make ``tokenizer`` usable for batched generation; changes it in place and returns it.

    Pads on the left, so generated tokens follow the prompt directly; a tokenizer without a pad token gets
    its eos token as pad (with a warning), the usual convention for decoder-only models.
    """
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"tokenizer {type(tokenizer).__name__} has neither a pad nor an eos token; "
                "set tokenizer.pad_token before training"
            )
        warnings.warn(
            f"tokenizer has no pad token; using its eos token {tokenizer.eos_token!r} as pad token",
            stacklevel=2,
        )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _set_special_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Fill in pad/eos ids the model's configs lack, so ``generate`` pads and stops like the tokenizer."""
    for config in (model.config, model.generation_config):
        if config is None:
            continue
        if getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = tokenizer.pad_token_id
        if getattr(config, "eos_token_id", None) is None:
            config.eos_token_id = tokenizer.eos_token_id


class PolicyLoader(ABC):
    """Builds the tokenizer and the causal language model trained as the policy."""

    @abstractmethod
    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        """Return the tokenizer, left padding and with a pad token."""

    @abstractmethod
    def load_model(self, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
        """Return the model for ``tokenizer`` (the one returned by :meth:`load_tokenizer`)."""

    def model_for_export(self, model: PreTrainedModel) -> PreTrainedModel:
        """What ``ExportPolicy`` saves with ``save_pretrained``, given the trained ``model``.

        The trained model itself by default. A loader that wraps the model (e.g. ``LoRA``) returns what
        should be published instead; it must not modify ``model``, which training may still use.
        """
        return model


class Pretrained(PolicyLoader):
    """A pretrained causal LM from the Hugging Face hub or a local ``save_pretrained`` directory."""

    def __init__(
        self,
        name_or_path: str,
        revision: str | None = None,
        dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32",
        trust_remote_code: bool = False,
        attn_implementation: str | None = None,
    ) -> None:
        """Configure the model to load.

        Args:
            name_or_path: hub model name (e.g. ``Qwen/Qwen3-0.6B``) or a local directory holding model and
                tokenizer files.
            revision: hub branch, tag or commit; ``None`` for the default branch.
            dtype: dtype of the loaded weights; ``auto`` keeps the dtype stored with the checkpoint.
            trust_remote_code: allow model code shipped with the checkpoint to run.
            attn_implementation: attention kernel (``eager``, ``sdpa``, ``flash_attention_2``, ...);
                ``None`` lets transformers choose.
        """
        if dtype not in _DTYPES:
            raise SettingError(f"Pretrained.dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        check_local_checkpoint(name_or_path)
        self.name_or_path = name_or_path
        self.revision = revision
        self.dtype = dtype
        self.trust_remote_code = trust_remote_code
        self.attn_implementation = attn_implementation

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        """The checkpoint's tokenizer, prepared by :func:`prepare_tokenizer`."""
        with _named_load_errors(self.name_or_path):
            tokenizer = AutoTokenizer.from_pretrained(
                self.name_or_path, revision=self.revision, trust_remote_code=self.trust_remote_code
            )
        return prepare_tokenizer(tokenizer)

    def load_model(self, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
        """The checkpoint's causal LM, with pad/eos ids taken from ``tokenizer`` where it has none."""
        kwargs: dict[str, Any] = {"revision": self.revision, "dtype": _DTYPES[self.dtype]}
        if self.attn_implementation is not None:
            kwargs["attn_implementation"] = self.attn_implementation
        with _named_load_errors(self.name_or_path):
            model = AutoModelForCausalLM.from_pretrained(
                self.name_or_path, trust_remote_code=self.trust_remote_code, **kwargs
            )
        _set_special_token_ids(model, tokenizer)
        return model


def check_local_checkpoint(name_or_path: str) -> None:
    """A path meant as a local directory must be one: anything but a hub id (``namespace/name``) is a path, and a
    missing one would otherwise reach the hub client as a malformed repo id."""
    looks_local = name_or_path.startswith(("/", ".", "~")) or name_or_path.count("/") > 1
    path = Path(name_or_path).expanduser()
    if path.exists() or not looks_local:
        if path.exists() and not (path / "config.json").is_file():
            raise SettingError(
                f"Pretrained.name_or_path={name_or_path!r} has no config.json: not a directory "
                "written by save_pretrained"
            )
        return
    raise SettingError(
        f"Pretrained.name_or_path={name_or_path!r}: no such directory (a local save_pretrained "
        "directory, or a hub name such as 'Qwen/Qwen3-0.6B')"
    )


@contextmanager
def _named_load_errors(name_or_path: str) -> Iterator[None]:
    """A checkpoint that cannot be read (offline hub, no access, a broken directory) as one line naming it."""
    try:
        yield
    except OSError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SettingError(f"Pretrained.name_or_path={name_or_path!r}: {first}") from error


class TinyQwen3(PolicyLoader):
    """A randomly initialised tiny Qwen3 with a character tokenizer, small enough to train on a CPU."""

    def __init__(
        self,
        hidden_size: int = 128,
        num_layers: int = 4,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        intermediate_size: int = 512,
        max_position_embeddings: int = 64,
        alphabet: str = DEFAULT_ALPHABET,
        seed: int = 0,
        chat_template: str | None = None,
    ) -> None:
        """Configure the model's shape and initialisation.

        Args:
            hidden_size: width of the residual stream; a multiple of ``num_heads``.
            num_layers: number of decoder layers.
            num_heads: attention (query) heads; a multiple of ``num_kv_heads``.
            num_kv_heads: key/value heads (grouped-query attention).
            intermediate_size: width of the MLP.
            max_position_embeddings: longest sequence (prompt + response) the model handles.
            alphabet: characters of the character-level tokenizer.
            seed: seed of the random initialisation (the global RNG is left untouched).
            chat_template: a Jinja chat template for the tokenizer, for chat prompts (data
                ``chat_template: true``), or a built-in one by name: ``simple`` ("role: content" lines) or
                ``tools`` (compact, with tools, for episodes); None for none. ``alphabet`` must cover the
                characters it and the prompts render to.
        """
        sizes = {
            "hidden_size": hidden_size,
            "num_layers": num_layers,
            "num_heads": num_heads,
            "num_kv_heads": num_kv_heads,
            "intermediate_size": intermediate_size,
            "max_position_embeddings": max_position_embeddings,
        }
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.alphabet = alphabet
        self.seed = seed
        self.chat_template = CHAT_TEMPLATES.get(chat_template, chat_template) if chat_template else chat_template

    def settings(self) -> dict[str, Any]:
        """The constructor arguments: everything that determines the model (used as a cache key).

        ``chat_template`` is included only when set, so that the keys of existing caches (made before it
        existed) stay valid; a cache keeps the tokenizer too, so a template does belong in the key.
        """
        settings = {name: getattr(self, name) for name in _TINY_SETTINGS}
        if self.chat_template is not None:
            settings["chat_template"] = self.chat_template
        return settings

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        """The character tokenizer over ``alphabet``, with ``chat_template`` if set."""
        return build_char_tokenizer(
            self.alphabet, model_max_length=self.max_position_embeddings, chat_template=self.chat_template
        )

    def load_model(self, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
        """A freshly initialised float32 ``Qwen3ForCausalLM`` sized for ``tokenizer``'s vocabulary."""
        config = Qwen3Config(**self.config_settings(tokenizer), intermediate_size=self.intermediate_size)
        return self.initialise(Qwen3ForCausalLM, config)

    def config_settings(self, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
        """The model-config fields every tiny Qwen3 shares: shape, vocabulary, special tokens, float32."""
        return {
            "vocab_size": len(tokenizer),
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.hidden_size // self.num_heads,  # Qwen3 otherwise defaults to 128 whatever the width
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": True,
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": None,
            "dtype": "float32",
        }

    def initialise(self, model_class: type[PreTrainedModel], config: Any) -> PreTrainedModel:
        """``model_class(config)`` in float32, initialised from ``seed``."""
        # fork_rng: initialising from our own seed must not shift the caller's random stream
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = model_class(config)
        return model.to(torch.float32)

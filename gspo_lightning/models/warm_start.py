"""Supervised warm start of the tiny policy, so RL starts from a model that already succeeds sometimes.

A randomly initialised model never answers correctly, so every GSPO group would get the same reward and no
learning signal. A warm start first trains the tiny model on train-side demonstrations of the task until its
greedy accuracy reaches ``target_accuracy`` (low enough to leave RL something to improve), and caches the
result on disk, keyed by a hash of every setting, so later runs and other ranks reuse it.
``SupervisedWarmStart`` is the recipe; each task's own loader sits next to the task in ``gspo_lightning.data``:
``WarmStartedTinyQwen3`` (arithmetic, the quick start), ``CountdownWarmStartedTinyQwen3``,
``ScratchpadWarmStartedTinyQwen3``.
"""

from __future__ import annotations

import logging
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from gspo_lightning.models.cache import cache_root, is_complete, save_atomically, settings_hash
from gspo_lightning.models.loaders import PolicyLoader, TinyQwen3
from gspo_lightning.models.supervised import evaluate_accuracy, train_warm_start, training_batch
from gspo_lightning.validation import SettingError

WARM_START_VERSION = 1
"""Bump when the training recipe changes, so caches of the old recipe are no longer used."""

# what determines the trained weights besides the base model and the task; hashed into the cache key
_TRAINING_SETTINGS = "prompt_template max_steps batch_size lr target_accuracy eval_every eval_size seed".split()

logger = logging.getLogger("gspo_lightning")


class SupervisedWarmStart(PolicyLoader, ABC):
    """A ``TinyQwen3`` trained with supervised next-token loss on a task's demonstrations until partly right.

    Subclasses name the task: which settings define it, how demonstrations are drawn and what counts as a
    correct completion. Demonstrations are dicts holding the prompt template's fields and the ``"answer"``
    the model learns to write.
    """

    task_settings: tuple[str, ...] = ()
    """Names of the subclass's attributes that define the task (part of the cache key)."""
    answer_characters: str = ""
    """Characters answers may use beyond those of :meth:`longest_demonstration`; the alphabet must have them."""

    def __init__(
        self,
        base: TinyQwen3 | None = None,
        prompt_template: str = "{question}=",
        max_steps: int = 2000,
        batch_size: int = 64,
        lr: float = 1e-3,
        target_accuracy: float | None = 0.3,
        eval_every: int = 20,
        eval_size: int = 256,
        seed: int = 0,
        cache_dir: str | None = None,
    ) -> None:
        """Configure the model and its warm start.

        Args:
            base: the untrained model (shape, tokenizer alphabet, init seed); ``TinyQwen3()`` when omitted.
            prompt_template: prompt format with the task's fields; must match the RL prompts.
            max_steps: most optimizer steps, if ``target_accuracy`` is not reached before.
            batch_size: problems per optimizer step.
            lr: peak AdamW learning rate (after a short linear warmup).
            target_accuracy: stop as soon as greedy accuracy on train-side problems reaches this (None: train
                all ``max_steps``).
            eval_every: measure accuracy every this many steps.
            eval_size: problems per accuracy measurement.
            seed: seed of the training data order and of torch's RNG during training.
            cache_dir: cache root; defaults to ``$GSPO_LIGHTNING_CACHE``, else ``~/.cache/gspo_lightning``.
        """
        counts = {"max_steps": max_steps, "batch_size": batch_size, "eval_every": eval_every, "eval_size": eval_size}
        for name, value in counts.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if target_accuracy is not None and not 0.0 <= target_accuracy <= 1.0:
            raise ValueError(f"target_accuracy must be in [0, 1], got {target_accuracy}")
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        self.base = base if base is not None else TinyQwen3()
        self.prompt_template = prompt_template
        self.max_steps = max_steps
        self.batch_size = batch_size
        self.lr = lr
        self.target_accuracy = target_accuracy
        self.eval_every = eval_every
        self.eval_size = eval_size
        self.seed = seed
        self.cache_dir = cache_dir

    @abstractmethod
    def demonstrations(self, count: int, seed: int) -> Iterator[dict[str, str]]:
        """``count`` train-side demonstrations: the prompt template's fields and the ``"answer"``."""

    @abstractmethod
    def is_correct(self, demonstration: dict[str, str], completion: str) -> bool:
        """Whether ``completion`` (decoded, up to its first eos) solves the demonstration's problem."""

    @abstractmethod
    def longest_demonstration(self) -> dict[str, str]:
        """A demonstration at least as long as any the task can draw, to check it fits the model."""

    def training_batch(self, tokenizer: PreTrainedTokenizerBase, demonstrations: list[dict[str, Any]]) -> dict[str, Any]:
        """One supervised batch: ``prompt + answer + eos`` rows with loss on the answer (``training_batch``)."""
        return training_batch(tokenizer, demonstrations, self.prompt_template)

    def accuracy(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, demonstrations: list[dict[str, Any]]) -> float:
        """Greedy accuracy on ``demonstrations``, the stopping criterion (``evaluate_accuracy``)."""
        return evaluate_accuracy(model, tokenizer, demonstrations, self)

    def check_fits_model(self) -> None:
        """Fail at configuration time, not after training starts, if a sample cannot fit the model.

        Subclasses call it at the end of their constructor, once the task is set.
        """
        widest = self.longest_demonstration()
        text = self.prompt_template.format(**widest) + widest["answer"]
        unknown = sorted(set(text + self.answer_characters) - set(self.base.alphabet))
        if unknown:
            raise ValueError(f"base.alphabet lacks characters the task writes: {unknown}")
        longest = len(text) + 1  # one token per character, then eos
        if longest > self.base.max_position_embeddings:
            raise ValueError(
                f"samples of up to {longest} tokens do not fit base.max_position_embeddings="
                f"{self.base.max_position_embeddings}"
            )

    def check_matches(self, source: Any, prompt_template: str | None) -> None:
        """Refuse to warm-start on another task than RL trains on: each of ``task_settings`` the data ``source``
        also has, and the prompt template, must be equal (checked at fit start, before the warm start trains)."""
        shared = [name for name in self.task_settings if hasattr(source, name)]
        pairs = [(name, getattr(self, name), getattr(source, name)) for name in shared]
        if prompt_template is not None:
            pairs.append(("prompt_template", self.prompt_template, prompt_template))
        for name, warm, task in pairs:
            if warm != task:
                data = "prompt_template" if name == "prompt_template" else f"source.init_args.{name}"
                where = f"data.init_args.{data}"
                raise SettingError(
                    f"model.init_args.policy.init_args.{name}={warm!r} but {where}={task!r}: the warm start must learn "
                    "the task RL trains on; set them equal"
                )

    def settings(self) -> dict[str, Any]:
        """Everything that determines the trained weights: the cache key is a hash of it."""
        named = {name: getattr(self, name) for name in (*self.task_settings, *_TRAINING_SETTINGS)}
        return {"version": WARM_START_VERSION, "base": self.base.settings(), **named}

    def cache_path(self) -> Path:
        """Directory of this configuration's cached model: ``<root>/warm_start/<hash>``."""
        return cache_root(self.cache_dir) / "warm_start" / settings_hash(self.settings())

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        """The base model's character tokenizer."""
        return self.base.load_tokenizer()

    def load_model(self, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
        """The warm-started model from the cache, trained and cached first if this is the first use."""
        path = self.cache_path()
        ensure_cached(self, path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        if model.config.vocab_size != len(tokenizer):
            raise ValueError(
                f"cached warm start at {path} has vocab_size {model.config.vocab_size}, "
                f"but the tokenizer has {len(tokenizer)} tokens; use this loader's load_tokenizer()"
            )
        return model


def ensure_cached(loader: SupervisedWarmStart, path: Path) -> None:
    """Train and save the warm start at ``path`` unless a complete one is already there.

    The file lock makes concurrent processes (DDP ranks started together) wait for the first one to finish
    instead of each training its own copy. An incomplete entry (one written before the fix below, where a rank
    other than 0 held the lock) is trained again.
    """
    if is_complete(path):
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if is_complete(path):  # another process finished while we waited
            return
        if path.exists():
            logger.warning("warm start: the cache at %s lacks the model's files; training it again", path)
            shutil.rmtree(path)
        logger.info("warm start: no cache at %s, training", path)
        tokenizer = loader.load_tokenizer()
        model, report = train_warm_start(loader, tokenizer, path)
        save_atomically(model, tokenizer, report, path)



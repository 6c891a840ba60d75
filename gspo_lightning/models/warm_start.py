"""Supervised warm start of the tiny policy, so RL starts from a model that already succeeds sometimes.

A randomly initialised model never answers correctly, so every GSPO group would get the same reward and no
learning signal. A warm start first trains the tiny model on train-side demonstrations of the task until its
greedy accuracy reaches ``target_accuracy`` (low enough to leave RL something to improve), and caches the
result on disk, keyed by a hash of every setting, so later runs and other ranks reuse it.
``WarmStartedTinyQwen3`` does it for arithmetic (the quick start); ``CountdownWarmStartedTinyQwen3`` in
:mod:`gspo_lightning.models.countdown_warm_start` for Countdown.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from safetensors.torch import save_file
from torch import Tensor
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from gspo_lightning.data.arithmetic import arithmetic_problems
from gspo_lightning.models.loaders import PolicyLoader, TinyQwen3
from gspo_lightning.validation import SettingError

WARM_START_VERSION = 1
"""Bump when the training recipe changes, so caches of the old recipe are no longer used."""

REPORT_FILE = "warm_start.json"
MODEL_FILE = "model.safetensors"
CACHE_ENV_VAR = "GSPO_LIGHTNING_CACHE"
_EVAL_SEED_OFFSET = 1_000_003  # evaluation problems come from a different stream than the training ones
_EVAL_CHUNK = 256  # problems per generate call during evaluation
_IGNORE_INDEX = -100  # label of tokens that carry no loss (prompt, padding)
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
        target_accuracy: float = 0.3,
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
            target_accuracy: stop as soon as greedy accuracy on train-side problems reaches this.
            eval_every: measure accuracy every this many steps.
            eval_size: problems per accuracy measurement.
            seed: seed of the training data order and of torch's RNG during training.
            cache_dir: cache root; defaults to ``$GSPO_LIGHTNING_CACHE``, else ``~/.cache/gspo_lightning``.
        """
        counts = {"max_steps": max_steps, "batch_size": batch_size, "eval_every": eval_every, "eval_size": eval_size}
        for name, value in counts.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0.0 <= target_accuracy <= 1.0:
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


class WarmStartedTinyQwen3(SupervisedWarmStart):
    """``TinyQwen3`` trained on arithmetic (the quick-start task) until it is partly right.

    A randomly initialised model never answers correctly, so every GSPO group would get the same reward and no
    learning signal. This loader first trains the tiny model on train-side problems until its greedy
    exact-match accuracy reaches ``target_accuracy`` (low enough to leave RL something to improve), and caches
    the result on disk, keyed by a hash of every setting, so later runs and other ranks reuse it.
    """

    task_settings = ("num_digits", "operations")

    def __init__(self, num_digits: int = 3, operations: str = "+", **kwargs: Any) -> None:
        """
        Args:
            num_digits: digits of each operand, as in the RL task.
            operations: arithmetic operations to train on, a string of ``+-*``.
        """
        super().__init__(**kwargs)
        next(arithmetic_problems(1, num_digits, operations))  # validates digits and operations
        self.num_digits = num_digits
        self.operations = operations
        self.check_fits_model()

    def demonstrations(self, count: int, seed: int) -> Iterator[dict[str, str]]:
        return arithmetic_problems(count, self.num_digits, self.operations, seed=seed)

    def is_correct(self, demonstration: dict[str, str], completion: str) -> bool:
        return completion == demonstration["answer"]

    def longest_demonstration(self) -> dict[str, str]:
        widest = "9" * self.num_digits
        # a sum has a carry digit, a difference a sign, a product twice the digits
        answer = max(
            {"+": self.num_digits + 1, "-": self.num_digits + 1, "*": 2 * self.num_digits}[op] for op in self.operations
        )
        return {"question": f"{widest}{self.operations[0]}{widest}", "answer": "9" * answer}


def cache_root(cache_dir: str | None = None) -> Path:
    """Root of gspo_lightning's caches: ``cache_dir``, else ``$GSPO_LIGHTNING_CACHE``, else ``~/.cache``."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV_VAR):
        return Path(os.environ[CACHE_ENV_VAR]).expanduser()
    return Path.home() / ".cache" / "gspo_lightning"


def settings_hash(settings: dict[str, Any]) -> str:
    """A short, stable hash of JSON-serialisable settings."""
    canonical = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


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
        model, report = train_warm_start(loader, tokenizer)
        _save_atomically(model, tokenizer, report, path)


def is_complete(path: Path) -> bool:
    """The report, the model's config and its weights are all in ``path``."""
    return all((path / name).is_file() for name in (REPORT_FILE, "config.json", MODEL_FILE))


def _save_atomically(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, report: dict[str, Any], path: Path
) -> None:
    """Write model, tokenizer and report to a temp directory, then rename it into place.

    A reader never sees a half-written cache, even if this process is killed while saving. The tokenizer is
    saved too, so the directory also loads with ``Pretrained(name_or_path=...)``. The model is written with
    safetensors, not ``save_pretrained``: once torch.distributed is initialised, transformers writes a model
    only on global rank 0, and whichever rank holds the lock trains the warm start.
    """
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        model.config.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        save_file(_one_name_per_tensor(model), str(tmp / MODEL_FILE), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        (tmp / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _one_name_per_tensor(model: PreTrainedModel) -> dict[str, Tensor]:
    """The state dict with one name per shared tensor, the first in the model's order (the input embedding of
    tied weights, as ``save_pretrained`` keeps it: loading then initialises nothing, which would draw random
    numbers, and ties the head to it)."""
    tensors: dict[str, Tensor] = {}
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            tensors[name] = tensor.detach().contiguous()
    return tensors


def train_warm_start(
    loader: SupervisedWarmStart, tokenizer: PreTrainedTokenizerBase
) -> tuple[PreTrainedModel, dict[str, Any]]:
    """Train ``loader.base``'s model until it reaches the target accuracy; return it and a report."""
    start = time.monotonic()
    # fork_rng: a deterministic run that leaves the caller's random stream where it was
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(loader.seed)
        model = loader.base.load_model(tokenizer)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=loader.lr, weight_decay=0.0)
        warmup = max(1, min(100, loader.max_steps // 10))
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        train_stream = loader.demonstrations(loader.max_steps * loader.batch_size, loader.seed)
        eval_problems = list(loader.demonstrations(loader.eval_size, loader.seed + _EVAL_SEED_OFFSET))
        losses: list[float] = []
        history: list[dict[str, float]] = []
        for step in range(1, loader.max_steps + 1):
            batch = training_batch(tokenizer, list(islice(train_stream, loader.batch_size)), loader.prompt_template)
            losses.append(_optimizer_step(model, optimizer, schedule, batch))
            if step % loader.eval_every and step < loader.max_steps:
                continue
            accuracy = evaluate_accuracy(model, tokenizer, eval_problems, loader)
            recent = losses[-loader.eval_every :]
            seconds = round(time.monotonic() - start, 2)
            history.append({"step": step, "loss": sum(recent) / len(recent), "accuracy": accuracy, "seconds": seconds})
            logger.info(
                "warm start step %(step)d: loss %(loss).4f, accuracy %(accuracy).3f (%(seconds).1f s)", history[-1]
            )
            if accuracy >= loader.target_accuracy:
                break
    return model, _report(loader, history, losses, time.monotonic() - start)


def _report(
    loader: SupervisedWarmStart, history: list[dict[str, float]], losses: list[float], seconds: float
) -> dict[str, Any]:
    """The ``warm_start.json`` content: what was trained, how long it took and what it reached."""
    accuracy = history[-1]["accuracy"]
    reached = accuracy >= loader.target_accuracy
    if not reached:
        logger.warning(
            "warm start stopped at max_steps with accuracy %.3f < target %.3f", accuracy, loader.target_accuracy
        )
    return {
        "settings": loader.settings(),
        "cache_key": settings_hash(loader.settings()),
        "steps": len(losses),
        "accuracy": accuracy,
        "reached_target": reached,
        "seconds": round(seconds, 2),
        "first_loss": losses[0],
        "history": history,
    }


def _optimizer_step(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    batch: dict[str, Tensor],
) -> float:
    """One supervised step; returns the loss. Clipping guards against loss spikes."""
    loss = model(**batch).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    schedule.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def training_batch(
    tokenizer: PreTrainedTokenizerBase, problems: list[dict[str, str]], prompt_template: str
) -> dict[str, Tensor]:
    """Tokenise ``prompt + answer + eos`` rows, right padded, with loss only on answer and eos tokens.

    Right padding keeps every row's positions starting at 0, the positions ``generate`` gives a left-padded
    prompt (it derives them from the attention mask).
    """
    rows, label_rows = [], []
    for problem in problems:
        prompt = tokenizer.encode(prompt_template.format(**problem), add_special_tokens=False)
        target = tokenizer.encode(problem["answer"], add_special_tokens=False) + [tokenizer.eos_token_id]
        rows.append(prompt + target)
        label_rows.append([_IGNORE_INDEX] * len(prompt) + target)
    width = max(len(row) for row in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([row + [pad] * (width - len(row)) for row in rows])
    labels = torch.tensor([row + [_IGNORE_INDEX] * (width - len(row)) for row in label_rows])
    attention_mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


@torch.no_grad()
def evaluate_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    problems: list[dict[str, str]],
    loader: SupervisedWarmStart,
) -> float:
    """Greedy accuracy: the fraction of completions (up to their first eos) ``loader.is_correct`` accepts."""
    was_training = model.training
    model.eval()
    max_new_tokens = max(len(tokenizer.encode(p["answer"], add_special_tokens=False)) for p in problems) + 1
    correct = 0
    for begin in range(0, len(problems), _EVAL_CHUNK):
        chunk = problems[begin : begin + _EVAL_CHUNK]
        prompts = [loader.prompt_template.format(**p) for p in chunk]
        inputs = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        output = model.generate(
            **inputs,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        for problem, completion in zip(chunk, output[:, inputs["input_ids"].shape[1] :].tolist(), strict=True):
            if tokenizer.eos_token_id in completion:
                completion = completion[: completion.index(tokenizer.eos_token_id)]
            correct += loader.is_correct(problem, tokenizer.decode(completion))
    model.train(was_training)
    return correct / len(problems)

"""How a supervised warm start trains: next-token loss on a task's demonstrations (answer tokens only), AdamW with
a short linear warm-up and clipping, greedy accuracy on train-side problems every ``eval_every`` steps, stopping
at ``target_accuracy``. A progress bar shows the steps, the loss and the accuracy against its target.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gspo_lightning.models.cache import settings_hash

if TYPE_CHECKING:
    from gspo_lightning.models.warm_start import SupervisedWarmStart

_EVAL_SEED_OFFSET = 1_000_003  # evaluation problems come from a different stream than the training ones
_EVAL_CHUNK = 256  # problems per generate call during evaluation
_IGNORE_INDEX = -100  # label of tokens that carry no loss (prompt, padding)


def train_warm_start(
    loader: SupervisedWarmStart, tokenizer: PreTrainedTokenizerBase, destination: Path | None = None
) -> tuple[PreTrainedModel, dict[str, Any]]:
    """Train ``loader.base``'s model until it reaches the target accuracy; return it and a report. A progress bar
    (stderr) shows it, naming ``destination``, where the result will be cached."""
    start = time.monotonic()
    # fork_rng: a deterministic run that leaves the caller's random stream where it was
    with torch.random.fork_rng(devices=[]), _progress(loader, destination) as progress:
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
            batch = loader.training_batch(tokenizer, list(islice(train_stream, loader.batch_size)))
            losses.append(_optimizer_step(model, optimizer, schedule, batch))
            progress.update(1)
            if step % loader.eval_every and step < loader.max_steps:
                continue
            accuracy = loader.accuracy(model, tokenizer, eval_problems)
            recent = losses[-loader.eval_every :]
            seconds = round(time.monotonic() - start, 2)
            history.append({"step": step, "loss": sum(recent) / len(recent), "accuracy": accuracy, "seconds": seconds})
            progress.set_postfix_str(f"loss {history[-1]['loss']:.3f}, accuracy {accuracy:.1%}", refresh=False)
            if loader.target_accuracy is not None and accuracy >= loader.target_accuracy:
                break
    report = _report(loader, history, losses, time.monotonic() - start)
    outcome = "reached" if report["reached_target"] else "stopped at max_steps short of"
    if loader.target_accuracy is None:
        outcome = "its fixed number of steps"
    else:
        outcome += f" the target {loader.target_accuracy:.0%}"
    tqdm.write(
        f"warm start: {report['accuracy']:.1%} greedy accuracy after {report['steps']} steps ({report['seconds']:.0f} s), "
        f"{outcome}",
        file=sys.stderr,
    )
    return model, report


@contextmanager
def _progress(loader: SupervisedWarmStart, destination: Path | None) -> Iterator[tqdm]:
    """The warm start's bar: steps out of ``max_steps`` (it usually stops earlier, at the target)."""
    where = f"; cached in {destination}" if destination is not None else ""
    until = "for its steps" if loader.target_accuracy is None else f"until {loader.target_accuracy:.0%} greedy accuracy"
    tqdm.write(f"warm start: training the policy {until} (once{where})", file=sys.stderr)
    # Not drawn into a log file (a batch job's stderr), where its redraws pile up on one line: the lines before
    # and after say what it did.
    bar = tqdm(total=loader.max_steps, desc="warm start", unit="step", mininterval=1.0, dynamic_ncols=True,
               disable=not sys.stderr.isatty())  # fmt: skip
    try:
        yield bar
    finally:
        bar.close()


def _report(
    loader: SupervisedWarmStart, history: list[dict[str, float]], losses: list[float], seconds: float
) -> dict[str, Any]:
    """The ``warm_start.json`` content: what was trained, how long it took and what it reached."""
    accuracy = history[-1]["accuracy"]
    reached = loader.target_accuracy is not None and accuracy >= loader.target_accuracy
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

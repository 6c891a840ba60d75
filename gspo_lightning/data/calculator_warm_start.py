"""Supervised warm start of the tool-use demo: 3-digit multiplication, which a tiny model cannot do in its head
but can do with the ``calculator`` tool. It learns from transcripts of both habits: most answer at once (the
product written from the question alone, which it cannot learn to get right), some call the calculator and copy
its result. RL then has to discover that the calculator pays (``configs/tool_calculator.yaml``)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gspo_lightning.data.arithmetic import arithmetic_problems
from gspo_lightning.episodes.environment import ToolEnvironment
from gspo_lightning.episodes.rendering import encode, first_context, observation_ids
from gspo_lightning.episodes.tools import calculator
from gspo_lightning.models.char_tokenizer import ASCII_ALPHABET, TOOL_CHAT_TEMPLATE
from gspo_lightning.models.loaders import TinyQwen3
from gspo_lightning.models.warm_start import SupervisedWarmStart

_IGNORE_INDEX = -100
DEMO_SHAPE = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256,
                  max_position_embeddings=192, alphabet=ASCII_ALPHABET, chat_template=TOOL_CHAT_TEMPLATE)  # fmt: skip
"""The demo's policy: 2 layers of width 64 (about 0.1M parameters) train in about 0.1 s a step on 2 cores."""


def tool_call_text(expression: str) -> str:
    """The calculator call the transcripts write (Hermes / Qwen3 format)."""
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "' + expression + '"}}</tool_call>'


class CalculatorWarmStartedTinyQwen3(SupervisedWarmStart):
    """``TinyQwen3`` (ASCII characters, the compact tool chat template) trained on arithmetic transcripts, a
    ``tool_fraction`` of which call the calculator.

    Its accuracy (reported) is the fraction of train-side problems whose greedy first turn is the exact calculator
    call. It trains ``max_steps`` (800, about 80 s on 2 CPU cores; ``target_accuracy`` None): the greedy choice
    between calling and answering flips on small changes, so it makes a poor stopping rule. The defaults leave a policy that calls the calculator in about a quarter of its sampled episodes and
    solves about a sixth of held-out problems (``experiments/tool_calculator``).
    """

    task_settings = ("num_digits", "operations", "tool_fraction")
    answer_characters = ASCII_ALPHABET

    def __init__(
        self,
        num_digits: int = 3,
        operations: str = "*",
        tool_fraction: float = 0.3,
        base: TinyQwen3 | None = None,
        prompt_template: str = "{question}",
        max_steps: int = 800,
        batch_size: int = 32,
        lr: float = 2e-3,
        target_accuracy: float | None = None,
        eval_every: int = 100,
        eval_size: int = 64,
        seed: int = 0,
        cache_dir: str | None = None,
    ) -> None:
        """
        Args:
            num_digits: digits of each operand, as in the RL task.
            operations: arithmetic operations, a string of ``+-*``.
            tool_fraction: the fraction of transcripts that call the calculator, in [0, 1].
            base: the untrained model; ``TinyQwen3(**DEMO_SHAPE)`` when omitted.
            prompt_template: the user message's format; must match the RL prompts.
            max_steps, batch_size, lr, target_accuracy, eval_every, eval_size, seed, cache_dir: as in
                ``SupervisedWarmStart``.
        """
        super().__init__(base if base is not None else TinyQwen3(**DEMO_SHAPE), prompt_template, max_steps,
                         batch_size, lr, target_accuracy, eval_every, eval_size, seed, cache_dir)  # fmt: skip
        if not 0.0 <= tool_fraction <= 1.0:
            raise ValueError(f"tool_fraction must be in [0, 1], got {tool_fraction}")
        next(arithmetic_problems(1, num_digits, operations))  # validates digits and operations
        self.num_digits = num_digits
        self.operations = operations
        self.tool_fraction = tool_fraction
        self.check_fits_model()

    def demonstrations(self, count: int, seed: int) -> Iterator[dict[str, Any]]:
        habit = random.Random(seed + 1)
        for problem in arithmetic_problems(count, self.num_digits, self.operations, seed=seed):
            yield {**problem, "uses_tool": habit.random() < self.tool_fraction}

    def is_correct(self, demonstration: dict[str, Any], completion: str) -> bool:
        return completion == tool_call_text(demonstration["question"])

    def longest_demonstration(self) -> dict[str, Any]:
        widest = "9" * self.num_digits
        return {"question": f"{widest}{self.operations[0]}{widest}", "answer": "9" * (2 * self.num_digits + 1),
                "uses_tool": True}  # fmt: skip

    def transcript(self, tokenizer: PreTrainedTokenizerBase, demonstration: dict[str, Any]) -> tuple[list[int], list[int]]:
        """A demonstration's token ids and labels (-100 where nothing is learned: the prompt, the tool's result),
        built with the episode loop's own rendering, so they are exactly what RL rolls out."""
        environment = ToolEnvironment([calculator])
        user = [{"role": "user", "content": self.prompt_template.format(**demonstration)}]
        ids = first_context(tokenizer, user, environment.tools)
        labels = [_IGNORE_INDEX] * len(ids)
        eos = [tokenizer.eos_token_id]
        if demonstration["uses_tool"]:
            call = tool_call_text(demonstration["question"])
            result = environment.step(call).observation
            between = observation_ids(tokenizer, user + [{"role": "assistant", "content": call}], result, environment.tools)
            turn = encode(tokenizer, call) + eos
            ids, labels = ids + turn + between, labels + turn + [_IGNORE_INDEX] * len(between)
        answer = encode(tokenizer, demonstration["answer"]) + eos
        return ids + answer, labels + answer

    def training_batch(self, tokenizer: PreTrainedTokenizerBase, demonstrations: list[dict[str, Any]]) -> dict[str, Any]:
        rows = [self.transcript(tokenizer, d) for d in demonstrations]
        width = max(len(ids) for ids, _ in rows)
        pad = tokenizer.pad_token_id
        return {
            "input_ids": torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows]),
            "attention_mask": torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows]),
            "labels": torch.tensor([labels + [_IGNORE_INDEX] * (width - len(labels)) for _, labels in rows]),
        }

    @torch.no_grad()
    def accuracy(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, demonstrations: list[dict[str, Any]]) -> float:
        """The fraction whose greedy first turn is the exact calculator call."""
        was_training = model.training
        model.eval()
        tools = ToolEnvironment([calculator]).tools
        contexts = [first_context(tokenizer, [{"role": "user", "content": self.prompt_template.format(**d)}], tools)
                    for d in demonstrations]  # fmt: skip
        width = max(len(c) for c in contexts)
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(c)) + c for c in contexts])
        mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts])
        longest = len(encode(tokenizer, tool_call_text(self.longest_demonstration()["question"]))) + 1
        output = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=longest,
                                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
        correct = 0
        for demonstration, row in zip(demonstrations, output[:, width:].tolist(), strict=True):
            row = row[: row.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in row else row
            correct += self.is_correct(demonstration, tokenizer.decode(row))
        model.train(was_training)
        return correct / len(demonstrations)

    def check_fits_model(self) -> None:
        tokenizer = self.base.load_tokenizer()
        longest = len(self.transcript(tokenizer, self.longest_demonstration())[0])
        if longest > self.base.max_position_embeddings:
            raise ValueError(
                f"transcripts of up to {longest} tokens do not fit base.max_position_embeddings="
                f"{self.base.max_position_embeddings}"
            )

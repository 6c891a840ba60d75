"""A sampling engine that writes what a script says, for episode tests whose turns must be known exactly."""

from __future__ import annotations

from collections.abc import Callable

import torch

from gspo_lightning.engines.base import EngineSamples, SamplingEngine, right_padded
from gspo_lightning.models import TinyQwen3
from gspo_lightning.models.char_tokenizer import ASCII_ALPHABET, TOOL_CHAT_TEMPLATE
from tests.conftest import TINY

TOOL_TINY = dict(TINY, max_position_embeddings=512, alphabet=ASCII_ALPHABET, chat_template=TOOL_CHAT_TEMPLATE)


def tool_loader(**overrides) -> TinyQwen3:
    """A tiny random Qwen3 whose character tokenizer has the compact tool chat template."""
    return TinyQwen3(**(TOOL_TINY | overrides))


def calculator_call(expression: str) -> str:
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "' + expression + '"}}</tool_call>'


class ScriptedEngine(SamplingEngine):
    """Each row's continuation is ``respond(context text)`` followed by EOS (cut at ``max_new_tokens``); its
    "log-probs" are -0.01 * (column + 1) + -0.001 * row, distinct and known. ``calls`` records each batch's contexts."""

    name = "scripted"

    def __init__(self, respond: Callable[[str], str]) -> None:
        self.respond = respond
        self.calls: list[list[str]] = []

    def sample(self, policy, tokenizer, prompt_ids, prompt_mask, settings, group_size, with_logprobs=False,
               synced_gpus=False, seed=0, with_routes=False):  # fmt: skip
        contexts = [tokenizer.decode(ids[mask.bool()].tolist()) for ids, mask in zip(prompt_ids, prompt_mask)]
        self.calls.append(contexts)
        rows = []
        for context in contexts:
            reply = tokenizer(self.respond(context), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            rows += [reply[: settings.max_new_tokens]] * group_size
        response_ids = right_padded(rows, tokenizer.pad_token_id, prompt_ids.device)  # [N, R]
        columns = torch.arange(response_ids.shape[1], dtype=torch.float32)
        logprobs = -0.01 * (columns + 1) - 0.001 * torch.arange(len(rows), dtype=torch.float32)[:, None]  # [N, R]
        ended = (response_ids == tokenizer.eos_token_id).any(-1)
        return EngineSamples(response_ids, ended, logprobs if with_logprobs else None)


def calculator_policy(context: str) -> str:
    """Calls the calculator on the question, then answers with its result."""
    if "T:" in context.split("U:")[-1]:
        return context.split("T:")[-1].split("\n")[0]
    question = context.split("U:")[-1].split("\n")[0]
    return calculator_call(question)

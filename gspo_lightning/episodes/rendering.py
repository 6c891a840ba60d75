"""Token in, token out: the conversation's tokens are the ones the engine sampled, plus the chat template's tokens
for everything else.

The policy's turns are never decoded and re-encoded (a re-encoding need not give the ids that were sampled, and
the log-probs would then describe tokens nobody drew). What comes between two turns (the end of the assistant
message, the tool results or observations, the next generation prompt) is rendered by the chat template: the
conversation is rendered with the new messages, and the text after the policy turn's end-of-sequence marker is
encoded. Counting end markers rather than comparing prefixes keeps this right for templates that render a
message differently once it is no longer the last one (Qwen3 drops an empty ``<think></think>`` from earlier
turns). With a template that only ever appends, the result is exactly the encoding of the full rendering
(``tests/episodes/test_rendering.py``).
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from gspo_lightning.episodes.environment import Message
from gspo_lightning.validation import SettingError


def render(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], tools: list[dict[str, Any]], generation_prompt: bool
) -> str:
    """The chat template's text for ``messages`` (with the tools' schemas, when there are tools)."""
    if not getattr(tokenizer, "chat_template", None):
        raise SettingError(
            "sampler.episodes needs a tokenizer with a chat template (it renders the messages between turns): use "
            "a chat model's tokenizer or give TinyQwen3 a chat_template"
        )
    extra = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **extra)


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Rendered text as ids: the template wrote every special token it needs."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def first_context(tokenizer: PreTrainedTokenizerBase, messages: list[Message], tools: list[dict[str, Any]]) -> list[int]:
    """The ids of an episode's first messages, ending with the generation prompt of the first turn."""
    return encode(tokenizer, render(tokenizer, messages, tools, generation_prompt=True))


def observation_ids(
    tokenizer: PreTrainedTokenizerBase,
    history: list[Message],
    new_messages: list[Message],
    tools: list[dict[str, Any]],
) -> list[int]:
    """The ids that follow the policy's last turn (``history[-1]``, which ended with EOS) when ``new_messages``
    are appended: the template's close of that turn, the new messages and the next generation prompt."""
    marker = tokenizer.eos_token
    closed = render(tokenizer, history, tools, generation_prompt=False)
    turn_end = closed.count(marker)
    if not marker or turn_end == 0:
        raise SettingError(
            f"the chat template does not end an assistant message with the tokenizer's EOS token {marker!r}, so "
            "the tokens between a turn and the next observation cannot be told apart: use a template that closes "
            "every assistant message with it"
        )
    extended = render(tokenizer, history + new_messages, tools, generation_prompt=True)
    start = _after_occurrence(extended, marker, turn_end)
    if start is None:
        raise SettingError("the chat template renders fewer EOS markers once messages are appended: not supported")
    return encode(tokenizer, extended[start:])


def _after_occurrence(text: str, marker: str, count: int) -> int | None:
    """The index just after the ``count``-th occurrence of ``marker`` in ``text`` (None: fewer occurrences)."""
    position = -len(marker)
    for _ in range(count):
        position = text.find(marker, position + len(marker))
        if position < 0:
            return None
    return position + len(marker)

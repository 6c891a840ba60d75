"""A character-level tokenizer built locally, so tests and the quick start need no hub download.

One token per character of a fixed alphabet, plus ``<pad>`` (id 0), ``<eos>`` (id 1) and ``<unk>`` (id 2).
It is a plain ``PreTrainedTokenizerFast`` backed by a ``tokenizers.Tokenizer``, so it saves and reloads with
``save_pretrained`` / ``AutoTokenizer.from_pretrained`` like any hub tokenizer.
"""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

DEFAULT_ALPHABET = "0123456789+-*=() "
# Every printable ASCII character plus newline: enough for English word problems rendered in a chat template.
ASCII_ALPHABET = string.digits + string.ascii_letters + string.punctuation + " \n"
# A minimal chat template for tests and CPU demos: "role: content" lines, then "assistant: " to answer after.
SIMPLE_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
# A compact chat template with tools for CPU demos and tests of episodes: the tools' names on a first line, then
# "U:" / "T:" lines for user and tool messages; an assistant message is "A:" + its text + EOS, as sampled.
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}{{ 'tools:' }}{% for tool in tools %}{{ ' ' + tool['function']['name'] }}{% endfor %}"
    "{{ '\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ 'A:' + message['content'] + '<eos>' }}"
    "{% elif message['role'] == 'tool' %}{{ 'T:' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'system' %}{{ 'S:' + message['content'] + '\n' }}"
    "{% else %}{{ 'U:' + message['content'] + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'A:' }}{% endif %}"
)
CHAT_TEMPLATES = {"simple": SIMPLE_CHAT_TEMPLATE, "tools": TOOL_CHAT_TEMPLATE}
"""The built-in templates by the names ``TinyQwen3(chat_template=...)`` accepts."""
PAD_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)  # order fixes their ids: 0, 1, 2


def build_char_tokenizer(
    alphabet: str = DEFAULT_ALPHABET, model_max_length: int = 1024, chat_template: str | None = None
) -> PreTrainedTokenizerFast:
    """Build a character-level tokenizer: one token per character of ``alphabet``.

    Args:
        alphabet: the characters the tokenizer knows, each once; any other character encodes to ``<unk>``.
        model_max_length: the longest sequence the model accepts (stored in the tokenizer's config).
        chat_template: a Jinja chat template (``tokenizer.chat_template``), so that chat prompts can be
            rendered; None for none. The text it renders is tokenized character by character too, so
            ``alphabet`` must cover it.

    Returns:
        A left-padding tokenizer with pad ``<pad>`` (0), eos ``<eos>`` (1), unk ``<unk>`` (2) and no BOS;
        ``encode`` adds no special tokens and ``decode`` joins characters without spaces.
    """
    if not alphabet:
        raise ValueError("alphabet must not be empty")
    repeated = sorted({char for char in alphabet if alphabet.count(char) > 1})
    if repeated:
        raise ValueError(f"alphabet must list each character once; repeated: {repeated}")
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for char in alphabet:
        vocab[char] = len(vocab)
    # A BPE model with no merges splits any text into single characters, spaces included, with no
    # pre-tokenizer; Fuse() then decodes by plain concatenation instead of joining tokens with spaces.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",  # generation appends to the right end of the prompt
        model_max_length=model_max_length,
        # the default clean-up would alter spaces around punctuation, breaking the round trip
        clean_up_tokenization_spaces=False,
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template  # saved and reloaded by save_pretrained / from_pretrained
    return tokenizer

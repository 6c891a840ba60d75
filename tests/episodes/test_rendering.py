"""Token in, token out: what is appended between turns, against the template's full rendering."""

import pytest

from gspo_lightning.episodes import ToolEnvironment, calculator
from gspo_lightning.episodes.rendering import encode, first_context, observation_ids, render
from gspo_lightning.models.char_tokenizer import ASCII_ALPHABET, TOOL_CHAT_TEMPLATE, build_char_tokenizer
from gspo_lightning.validation import SettingError
from tests.episodes.scripted import calculator_call

# Renders the last assistant message with a marker earlier ones lose, as Qwen3's template drops the empty
# <think></think> of earlier turns: a conversation's rendering is then not a prefix of its continuation's.
REWRITING_TEMPLATE = TOOL_CHAT_TEMPLATE.replace(
    "{{ 'A:' + message['content'] + '<eos>' }}",
    "{% if loop.last %}{{ 'A:~' + message['content'] + '<eos>' }}{% else %}{{ 'A:' + message['content'] + '<eos>' }}"
    "{% endif %}",
)


def conversation():
    """A 3-turn tool conversation: (messages before each turn's observation, the observation) pairs."""
    user = [{"role": "user", "content": "12*34+5"}]
    turns = [calculator_call("12*34"), calculator_call("408+5"), "413"]
    results = [[{"role": "tool", "name": "calculator", "content": "408"}],
               [{"role": "tool", "name": "calculator", "content": "413"},
                {"role": "tool", "name": "calculator", "content": "again"}]]  # fmt: skip
    return user, turns, results


@pytest.mark.parametrize("template", [TOOL_CHAT_TEMPLATE, REWRITING_TEMPLATE])
def test_the_token_stream_is_the_full_rendering_when_turns_are_encoded_as_the_template_would(template):
    tokenizer = build_char_tokenizer(ASCII_ALPHABET, chat_template=template)
    tools = ToolEnvironment([calculator]).tools
    user, turns, results = conversation()
    stream, messages = first_context(tokenizer, user, tools), list(user)
    for index, turn in enumerate(turns):
        stream += encode(tokenizer, turn) + [tokenizer.eos_token_id]  # the sampled turn, as if canonical
        messages.append({"role": "assistant", "content": turn})
        if index < len(results):
            stream += observation_ids(tokenizer, messages, results[index], tools)
            messages += results[index]
    full = encode(tokenizer, render(tokenizer, messages, tools, generation_prompt=False))
    if template is TOOL_CHAT_TEMPLATE:  # append-only: exactly the full rendering
        assert stream == full
    else:  # the earlier turns as the model saw them, not as the template rewrites them at the end
        assert stream != full and tokenizer.decode(stream) == tokenizer.decode(full).replace("A:~", "A:")


def test_the_observation_is_the_templates_text_between_the_turn_and_the_next_generation_prompt():
    tokenizer = build_char_tokenizer(ASCII_ALPHABET, chat_template=TOOL_CHAT_TEMPLATE)
    history = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": calculator_call("1+1")}]
    ids = observation_ids(tokenizer, history, [{"role": "tool", "name": "calculator", "content": "2"}], [])
    assert tokenizer.decode(ids) == "T:2\nA:"


def test_sampled_ids_are_never_re_encoded():
    """A turn whose ids are not the canonical encoding of its text (here: an unknown character's <unk>) stays
    as sampled; only the observation is encoded."""
    tokenizer = build_char_tokenizer(ASCII_ALPHABET, chat_template=TOOL_CHAT_TEMPLATE)
    sampled = [tokenizer.unk_token_id, tokenizer.convert_tokens_to_ids("7"), tokenizer.eos_token_id]
    text = tokenizer.decode(sampled, skip_special_tokens=True)
    assert text == "7" and encode(tokenizer, text) != sampled[:-1]  # decode -> encode would lose the <unk>


def test_a_template_that_does_not_close_assistant_messages_with_eos_is_refused():
    tokenizer = build_char_tokenizer(ASCII_ALPHABET, chat_template=TOOL_CHAT_TEMPLATE.replace("'<eos>'", "'\\n'"))
    history = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]
    with pytest.raises(SettingError, match="does not end an assistant message with the tokenizer's EOS token '<eos>'"):
        observation_ids(tokenizer, history, [{"role": "user", "content": "sure?"}], [])


def test_a_tokenizer_without_a_chat_template_is_refused():
    with pytest.raises(SettingError, match="sampler.episodes needs a tokenizer with a chat template"):
        first_context(build_char_tokenizer(ASCII_ALPHABET), [{"role": "user", "content": "x"}], [])

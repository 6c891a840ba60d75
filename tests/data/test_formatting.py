"""PromptFormatter: plain and chat prompts, and its early errors."""

from __future__ import annotations

import pytest

from gspo_lightning.data import PromptFormatter

ROW = {"question": "12+30", "answer": "42", "topic": "sums"}


def test_plain_prompt_is_the_formatted_template() -> None:
    formatter = PromptFormatter("Q: {question} ({topic})\nA:")
    assert formatter(ROW) == "Q: 12+30 (sums)\nA:"
    assert formatter.fields == ("question", "topic")


def test_chat_prompt_without_system_prompt() -> None:
    assert PromptFormatter("{question}=", chat=True)(ROW) == [{"role": "user", "content": "12+30="}]


def test_chat_prompt_with_system_prompt() -> None:
    formatter = PromptFormatter(chat=True, system_prompt="Answer with a number.")
    assert formatter(ROW) == [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "12+30"},
    ]


def test_missing_column_error_lists_missing_and_available() -> None:
    formatter = PromptFormatter("{problem} in {unit}")
    with pytest.raises(ValueError, match="problem") as info:
        formatter.check_columns(["question", "answer"], where="the 'eval' split")
    message = str(info.value)
    assert "['problem', 'unit']" in message and "['question', 'answer']" in message and "'eval' split" in message
    PromptFormatter("{question}").check_columns(["question", "answer"])  # no error


def test_system_prompt_requires_chat() -> None:
    with pytest.raises(ValueError, match="chat=True"):
        PromptFormatter(system_prompt="Be brief.")


@pytest.mark.parametrize("template", ["{}", "{0}", "{question", "question}"])
def test_bad_templates_fail_early(template: str) -> None:
    with pytest.raises(ValueError, match="template"):
        PromptFormatter(template)

"""Turning one data set row into the prompt the policy sees: a plain string or a chat conversation."""

from __future__ import annotations

import string
from collections.abc import Iterable, Mapping
from typing import Any

from gspo_lightning.rollout.types import Prompt
from gspo_lightning.validation import SettingError


def template_fields(template: str) -> tuple[str, ...]:
    """The column names a ``str.format`` template refers to, in order of first use.

    ``"{row.x}"`` and ``"{row[0]}"`` both refer to column ``row``. Raises ``ValueError`` for a malformed
    template or a positional field (``{}``, ``{0}``): rows are passed by column name only.
    """
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as error:
        raise SettingError(f"prompt template {template!r} is not a valid format string: {error}") from None
    fields: list[str] = []
    for _, field_name, _, _ in parsed:
        if field_name is None:  # literal text only
            continue
        column = field_name.split(".", 1)[0].split("[", 1)[0]
        if not column or column.isdigit():
            raise SettingError(
                f"prompt template {template!r} has a positional field {{{field_name}}}; "
                "name a column instead, e.g. '{question}'"
            )
        if column not in fields:
            fields.append(column)
    return tuple(fields)


class PromptFormatter:
    """Formats a data set row into a prompt with a ``str.format`` template over the row's columns."""

    def __init__(self, template: str = "{question}", chat: bool = False, system_prompt: str | None = None) -> None:
        """
        Args:
            template: Python format string over the data set's columns, e.g. ``"Q: {question}\\nA:"``.
            chat: Build a chat conversation (a list of ``{"role", "content"}`` messages, rendered later by the
                tokenizer's chat template) instead of a plain string.
            system_prompt: Content of a leading system message; requires ``chat=True``.
        """
        if system_prompt is not None and not chat:
            raise SettingError(
                "system_prompt is only used for chat prompts: set chat=True (chat_template: true) "
                "or put the instruction into the prompt template instead"
            )
        self.fields = template_fields(template)  # validates the template early
        self.template = template
        self.chat = chat
        self.system_prompt = system_prompt

    def __call__(self, row: Mapping[str, Any]) -> Prompt:
        """The prompt for one row: a string, or a list of chat messages when ``chat`` is set."""
        text = self.template.format(**row)
        if not self.chat:
            return text
        messages: list[dict[str, str]] = []
        if self.system_prompt is not None:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": text})
        return messages

    def check_columns(self, column_names: Iterable[str], where: str = "the data set") -> None:
        """Raise ``ValueError`` if the template names a column that ``column_names`` lacks.

        Args:
            column_names: the columns the rows will have.
            where: how to name the data in the message, e.g. ``"the 'eval' split"``.
        """
        available = list(column_names)
        missing = [name for name in self.fields if name not in available]
        if missing:
            raise SettingError(
                f"prompt template {self.template!r} uses column(s) {missing} that {where} does not have; "
                f"available columns: {available}"
            )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(template={self.template!r}, chat={self.chat}, "
            f"system_prompt={self.system_prompt!r})"
        )

from gspo_lightning.episodes import HermesToolCallParser, ToolCall
from gspo_lightning.episodes.parsers import resolve_parser

import pytest

PARSER = HermesToolCallParser()


def test_a_turn_without_a_call_has_none():
    assert PARSER.parse("the answer is 42") == []


def test_calls_are_read_in_order_with_their_arguments():
    turn = ('thinking <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call> then '
            '<tool_call>{"name": "neg", "arguments": {"x": -3}}</tool_call>')  # fmt: skip
    calls = PARSER.parse(turn)
    assert [(c.name, c.arguments, c.error) for c in calls] == [("add", {"a": 1, "b": 2}, None), ("neg", {"x": -3}, None)]


def test_arguments_written_as_a_json_string_are_read():
    call = PARSER.parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')[0]
    assert call == ToolCall("f", {"x": 1}, '{"name": "f", "arguments": "{\\"x\\": 1}"}')


def test_missing_arguments_mean_none():
    assert PARSER.parse('<tool_call>{"name": "now"}</tool_call>')[0].arguments == {}


@pytest.mark.parametrize(
    ("turn", "error"),
    [
        ("<tool_call>{name: f}</tool_call>", "not valid JSON"),
        ('<tool_call>{"name": "f", "arguments": {"x": 1}}', "not closed with </tool_call>"),
        ('<tool_call>["f"]</tool_call>', 'a JSON object with a "name"'),
        ('<tool_call>{"arguments": {}}</tool_call>', 'a JSON object with a "name"'),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '"arguments" must be a JSON object'),
    ],
)
def test_a_malformed_call_is_kept_with_its_error(turn, error):
    (call,) = PARSER.parse(turn)
    assert error in call.error


def test_custom_tags_and_named_parsers():
    parser = HermesToolCallParser("[[", "]]")
    assert parser.parse('[[{"name": "f"}]]')[0].name == "f"
    assert isinstance(resolve_parser("hermes"), HermesToolCallParser)
    with pytest.raises(ValueError, match=r"sampler.episodes.tool_parser must be one of \['hermes'\]"):
        resolve_parser("json")

"""Tool calling's pure parts (zserve/frontends/tool_calls.py): the request checks, the forced schemas, and the
parsers per family, fed whole and in every split into two chunks and token-sized pieces (a stream's deltas
must always reassemble into the whole answer)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from zserve.errors import BadRequest
from zserve.frontends import tool_calls as tc

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time"}}


def _assemble(stream: tc.ToolCallStream, chunks: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """What a client rebuilds from the stream's pieces (OpenAI's delta rules)."""
    pieces = [p for chunk in chunks for p in stream.feed(chunk)] + stream.finish()
    content, calls = "", {}
    for p in pieces:
        if p.content is not None:
            content += p.content
        elif p.id is not None:
            assert p.index not in calls and p.arguments == "" and p.name
            calls[p.index] = [p.name, ""]
        else:
            calls[p.index][1] += p.arguments
    return content or None, [tuple(calls[i]) for i in sorted(calls)]


def _every_split(mode: str, text: str, **kw) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = tc.whole(tc.ToolCallStream(mode, **kw), text)
    whole = content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    for cut in range(len(text) + 1):
        assert _assemble(tc.ToolCallStream(mode, **kw), [text[:cut], text[cut:]]) == whole, cut
    assert _assemble(tc.ToolCallStream(mode, **kw), list(text)) == whole
    return whole


def test_hermes_calls_between_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')  # fmt: skip
    content, calls = _every_split("hermes", text)
    assert content == "Let me check."
    assert calls == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert _every_split("hermes", text, parallel=False)[1] == calls[:1]


def test_hermes_without_calls_is_content_and_a_broken_call_stays_text():
    assert _every_split("hermes", "Hello <tool world  ") == ("Hello <tool world", [])
    broken = "A <tool_call>{not json}</tool_call> B"
    assert _every_split("hermes", broken) == (broken, [])
    # an unclosed call at the end (the model stopped after the JSON) still counts
    assert _every_split("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}}') == (None, [("f", '{"a": 1}')])
    assert _every_split("hermes", "  \n ") == (None, [])


def test_llama3_json_calls():
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}'
    )
    assert _every_split("llama3", text) == (None, [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")])
    assert _every_split("llama3", ' {"name": "f", "arguments": {"x": [1, 2]}}') == (None, [("f", '{"x": [1, 2]}')])
    assert _every_split("llama3", "The weather is fine.") == ("The weather is fine.", [])
    assert _every_split("llama3", '{"answer": 42}') == ('{"answer": 42}', [])  # JSON, not a call


def test_forced_outputs():
    assert _every_split("named", '{"city": "Rome"}', name="get_weather") == (
        None,
        [("get_weather", '{"city": "Rome"}')],
    )
    array = '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", "parameters": {}}]'
    assert _every_split("required", array) == (None, [("get_weather", '{"city": "Rome"}'), ("get_time", "{}")])
    assert _every_split("required", '[{"name": "get_wea') == ('[{"name": "get_wea', [])  # cut by max_tokens


def test_forced_schemas_accept_exactly_the_calls():
    functions = tc.check_tools([WEATHER, TIME])
    required = tc.forced_schema("required", functions, parallel=True)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "x"}}, {"name": "get_time", "parameters": {}}],
                        required)  # fmt: skip
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "nope", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    single = tc.forced_schema("required", functions, parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, single)
    named = tc.check_tool_choice({"type": "function", "function": {"name": "get_weather"}}, functions)
    assert tc.forced_schema(named, functions, True) == WEATHER["function"]["parameters"]
    assert tc.forced_schema("auto", functions, True) is None


@pytest.mark.parametrize(
    ("tools", "choice"),
    [
        ([{"type": "function", "function": {"name": "bad name"}}], None),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}], None),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None),
        ([WEATHER, WEATHER], None),
        ([{"type": "retrieval"}], None),
    ],
)
def test_bad_tools_name_tools(tools, choice):
    with pytest.raises(BadRequest) as info:
        tc.check_tools(tools)
    assert info.value.field == "tools"


def test_bad_tool_choice_and_history():
    functions = tc.check_tools([WEATHER])
    for choice in ({"type": "function", "function": {"name": "unknown"}}, "sometimes", {"type": "function"}):
        with pytest.raises(BadRequest) as info:
            tc.check_tool_choice(choice, functions)
        assert info.value.field == "tool_choice"
    with pytest.raises(BadRequest) as info:
        tc.check_tool_choice("required", [])
    assert info.value.field == "tool_choice"
    assert tc.check_tool_choice(None, functions) == "auto" and tc.check_tool_choice(None, []) == "none"
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    history = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]  # fmt: skip
    checked = tc.check_history(history)
    assert checked[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # as templates expect it
    unanswered = [history[0], history[1], {**history[2], "tool_call_id": "x"}]
    for bad in ([history[0], history[2]], unanswered):
        with pytest.raises(BadRequest) as info:
            tc.check_history(bad)
        assert info.value.field == "messages"


def test_parser_for_template():
    assert tc.parser_for_template("...<tool_call>\n{{ tool_call | tojson }}</tool_call>...") == "hermes"
    assert tc.parser_for_template('<|python_tag|>{"name": ..., "parameters": ...}') == "llama3"
    assert tc.parser_for_template(None) == "hermes"
    assert json.loads(json.dumps(tc.forced_schema("required", tc.check_tools([TIME]), True)))["minItems"] == 1

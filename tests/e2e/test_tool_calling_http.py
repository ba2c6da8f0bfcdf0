"""Tool calling through a whole deployment with the real openai client, on a tiny Qwen2 model whose chat
template renders tools as Qwen2.5's (tests/support/tiny_tool_lm.py), taught one Hermes call for ``auto``:
forced calls (required, named) parse against their schema; streamed deltas reassemble into the
non-streamed answer; bad tool input is a 400 naming its field."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import jsonschema
import openai
import pytest
from tiny_tool_lm import build_tiny_tool_lm, teach

import zserve
from zserve.generator import grammar

pytestmark = pytest.mark.skipif(not grammar.available(), reason="xgrammar is not installed (the structured extra)")

PARAMS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Tokyo"]},
          "days": {"type": "integer", "minimum": 1, "maximum": 7}, "metric": {"type": "boolean"}},
          "required": ["city", "days", "metric"], "additionalProperties": False}  # fmt: skip
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": PARAMS}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2, "metric": true}}\n</tool_call>'


@pytest.fixture(scope="module")
def oai(tmp_path_factory):
    from transformers import AutoTokenizer

    path = build_tiny_tool_lm(tmp_path_factory.mktemp("tinytool"))
    prompt = AutoTokenizer.from_pretrained(path).apply_chat_template(ASK, tools=[WEATHER], tokenize=False,
                                                                     add_generation_prompt=True)  # fmt: skip
    teach(path, prompt, CALL)
    options = {"path": str(path), "block_size": 8, "num_blocks": 1024, "max_running": 8, "max_new_tokens": 64}
    served = zserve.serve("zserve.models.causal_lm:CausalLM", name="tiny", options=options, timeout_ms=120_000)
    try:
        # closed before the deployment stops: an idle keep-alive connection left open holds its shutdown ~5 s
        with openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
            yield client
    finally:
        assert served.terminate() == 0


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _streamed(oai, **kw) -> tuple[str | None, list[tuple[str, str]], str]:
    content, calls, finish = "", {}, None
    for chunk in oai.chat.completions.create(model="tiny", stream=True, **kw):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.id is not None:
                assert d.index not in calls and d.type == "function" and d.function.name
                calls[d.index] = [d.function.name, d.function.arguments or ""]
            else:
                calls[d.index][1] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


def test_forced_calls_parse_against_the_schema(oai):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(6):
        messages = [{"role": "user", "content": f"city number {seed}?"}]
        kw = {"model": "tiny", "messages": messages, "tools": [WEATHER, TIME], "temperature": 1.0, "seed": seed,
              "max_tokens": 60}  # fmt: skip
        out = oai.chat.completions.create(**kw, tool_choice=named)
        [(name, arguments)] = _calls(out.choices[0].message)
        assert name == "get_weather" and out.choices[0].finish_reason == "stop"  # OpenAI's for a named choice
        jsonschema.validate(json.loads(arguments), PARAMS)
        out = oai.chat.completions.create(**kw, tool_choice="required", parallel_tool_calls=False)
        [(name, arguments)] = _calls(out.choices[0].message)
        assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.content is None
        schema = PARAMS if name == "get_weather" else TIME["function"]["parameters"]
        jsonschema.validate(json.loads(arguments), schema)


def test_auto_parses_the_models_own_hermes_call_streamed_or_not(oai):
    out = oai.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], temperature=0, max_tokens=60)
    message = out.choices[0].message
    assert _calls(message) == [("get_weather", '{"city": "Paris", "days": 2, "metric": true}')]
    assert message.content is None and out.choices[0].finish_reason == "tool_calls"
    assert message.tool_calls[0].id.startswith("call_")
    assert _streamed(oai, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=60) == (
        None, _calls(message), "tool_calls")  # fmt: skip
    kw = {"messages": ASK, "tools": [WEATHER], "temperature": 0, "max_tokens": 60, "logprobs": True}
    chunks = list(oai.chat.completions.create(model="tiny", stream=True, stream_options={"include_usage": True}, **kw))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(streamed) == chunks[-1].usage.completion_tokens  # a call's tokens' logprobs come with the call
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kw = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": choice, "temperature": 1.0, "seed": 3,
              "max_tokens": 60}  # fmt: skip
        whole = oai.chat.completions.create(model="tiny", **kw).choices[0]
        assert _streamed(oai, **kw) == (whole.message.content, _calls(whole.message), whole.finish_reason)


def test_a_tool_loop_history_renders_and_bad_input_is_a_400(oai):
    arguments = '{"city": "Paris", "days": 1, "metric": true}'
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 degrees"}]  # fmt: skip
    out = oai.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=8, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}
    for kw, param in [
        ({"messages": [*ASK, history[2]], "tools": [WEATHER]}, "messages"),
        ({"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"messages": ASK, "tools": [bad_tool]}, "tools"),
    ]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as info:
            oai.chat.completions.create(model="tiny", max_tokens=4, **kw)
        assert info.value.body["param"] == param and info.value.body["type"] == "invalid_request_error", kw


def test_a_two_turn_tool_loop_through_the_openai_agents_sdk(oai):
    """openai-agents, unchanged: tool_choice required forces the call, the SDK runs the tool, sends its result
    back as a tool message (tool_choice reset to auto), and the model's answer ends the run."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    seen = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"sunny in {city}"

    # parallel_tool_calls false: at most one forced call (a greedy random model would repeat calls to the limit)
    settings = ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=120)
    client = openai.AsyncOpenAI(base_url=str(oai.base_url), api_key="unused", max_retries=0)
    agent = Agent(name="weather", instructions="Answer about the weather.", tools=[get_weather],
                  model=OpenAIChatCompletionsModel(model="tiny", openai_client=client),
                  model_settings=settings)  # fmt: skip

    async def run():
        async with client:  # closed on its own loop: a keep-alive connection left open holds the shutdown ~5 s
            return await Runner.run(agent, "What is the weather in Paris?", max_turns=4)

    result = asyncio.run(run())  # what Runner.run_sync does, with the client closed
    assert seen and seen[0] in ("Paris", "Oslo"), [r.output for r in result.raw_responses]
    assert isinstance(result.final_output, str)
    assert len(result.raw_responses) >= 2  # the call, then the answer after the tool message

"""[limits]: each check refuses just past its limit with a 400 naming the field, and takes what is at the limit;
the config resolves max_inputs per model from its queue; one piece failing cancels the others."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from zserve.client.aio import gather_or_cancel
from zserve.config import FrontendSettings, LimitsConfig, endpoints_for, parse_config
from zserve.errors import BadRequest
from zserve.frontends.limits import Limits, schema_shape

SMALL = LimitsConfig(
    max_inputs=4, max_stop=2, max_stop_chars=5, max_logit_bias=3, max_tools=2, max_schema_bytes=400,
    max_schema_depth=6, max_schema_properties=3,
)  # fmt: skip


def refused(check, *args) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        check(*args)
    assert info.value.http_status == 400
    return info.value


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_inputs_at_and_past_the_limit_name_the_field():
    limits = Limits(SMALL, {"emb": 4})
    limits.check_inputs("emb", 4, "input")
    exc = refused(limits.check_inputs, "emb", 5, "input")
    assert exc.field == "input" and "max_inputs" in exc.message and "4" in exc.message
    # a model the settings do not list takes [limits] max_inputs
    assert refused(Limits(SMALL).check_inputs, "other", 5, "prompt").field == "prompt"


def test_max_inputs_defaults_to_an_eighth_of_each_models_queue():
    config = parse_config(
        '[[models]]\nname = "a"\nhandler = "m.x:A"\n'
        '[[models]]\nname = "b"\nhandler = "m.x:B"\nmax_queue = 4\n'
        '[[models]]\nname = "c"\nhandler = "m.x:C"\nmax_queue = 80\n'
    )
    settings = FrontendSettings.from_config(config, endpoints_for(config, Path("/tmp/x")), [])
    assert Limits.from_settings(settings).inputs == {"a": 128, "b": 1, "c": 10}
    configured = parse_config('[limits]\nmax_inputs = 7\n[[models]]\nname = "a"\nhandler = "m.x:A"\n')
    assert configured.limits.inputs_for(configured.models[0]) == 7


def test_stop_strings_count_and_length():
    limits = Limits(SMALL)
    limits.check_stop(["ab", "abcde"])
    limits.check_stop("abcde")
    limits.check_stop(None)
    assert refused(limits.check_stop, ["a", "b", "c"]).field == "stop"
    exc = refused(limits.check_stop, "abcdef")
    assert exc.field == "stop" and "max_stop_chars" in exc.message


def test_logit_bias_entries():
    limits = Limits(SMALL)
    limits.check_logit_bias({"1": 1, "2": 1, "3": 1})
    exc = refused(limits.check_logit_bias, {str(i): 1 for i in range(4)})
    assert exc.field == "logit_bias" and "max_logit_bias" in exc.message


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_tools_count_and_their_schemas_together():
    limits = Limits(SMALL)
    small = {"type": "object", "properties": {"x": {"type": "integer"}}}
    limits.check_tools([tool("a", small), tool("b", small)])
    assert refused(limits.check_tools, [tool(c, small) for c in "abc"]).field == "tools"
    # two properties each: fine alone, over max_schema_properties together
    two = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}
    limits.check_tools([tool("a", two)])
    exc = refused(limits.check_tools, [tool("a", two), tool("b", two)])
    assert exc.field == "tools" and "max_schema_properties" in exc.message


def test_schema_bytes_depth_and_properties_as_object_or_text():
    limits = Limits(SMALL)
    limits.check_schema(nested(2), "response_format")  # 5 levels: object, properties, a, properties, a
    limits.check_schema(json.dumps(nested(2)), "guided_json")
    exc = refused(limits.check_schema, nested(3), "response_format")
    assert exc.field == "response_format" and "max_schema_depth" in exc.message
    assert "max_schema_depth" in refused(limits.check_schema, json.dumps(nested(3)), "guided_json").message
    wide = {"type": "object", "properties": {k: {} for k in "abcd"}}
    assert "max_schema_properties" in refused(limits.check_schema, wide, "response_format").message
    big = {"type": "string", "description": "x" * 400}
    exc = refused(limits.check_schema, json.dumps(big), "guided_json")
    assert exc.field == "guided_json" and "max_schema_bytes" in exc.message
    limits.check_schema("{not json", "guided_json")  # the grammar's own error, not a limit


def test_schema_shape_walks_any_nesting_without_recursion():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    depth, _ = schema_shape(deep, 32)
    assert depth == 33  # stops one level past the limit
    assert schema_shape(nested(2), 100) == (5, 2)


def test_gather_or_cancel_cancels_the_other_pieces_on_a_failure():
    async def main() -> tuple[list[bool], str]:
        started = asyncio.Event()
        cancelled = [False] * 3

        async def piece(i: int) -> int:
            try:
                started.set()
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled[i] = True
                raise
            return i

        async def refused_piece() -> int:
            await started.wait()
            raise BadRequest("overloaded", field="prompt")

        with pytest.raises(BadRequest) as info:
            await asyncio.wait_for(gather_or_cancel([piece(0), piece(1), refused_piece(), piece(2)]), 10)
        await asyncio.sleep(0)  # the cancelled pieces run their handlers
        return cancelled, info.value.field

    cancelled, field = asyncio.run(main())
    assert cancelled == [True, True, True] and field == "prompt"


def test_gather_or_cancel_cancelled_from_outside_cancels_every_piece():
    async def main() -> int:
        cancelled = 0

        async def piece() -> None:
            nonlocal cancelled
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled += 1
                raise

        task = asyncio.get_running_loop().create_task(gather_or_cancel([piece() for _ in range(5)]))
        await asyncio.sleep(0.01)
        task.cancel()  # the caller hung up: its route's task is cancelled
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)
        return cancelled

    assert asyncio.run(main()) == 5

"""How much work one HTTP request may ask for (``[limits]`` of supervisor.toml): pure checks that the routes run
while they decode a body, before anything reaches the broker, so one caller cannot fill a model's queue, slow an
engine's every step (stop strings, ``logit_bias``) or hold its grammar compiler (tools, schemas). Past a limit,
``BadRequest`` naming the field (HTTP 400); each message says the limit and its ``[limits]`` key."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from zserve.config import FrontendSettings, LimitsConfig
from zserve.errors import BadRequest

# max_inputs for a model the settings do not list (a route built without settings): the default queue's eighth
_UNLISTED_INPUTS = 1024 // 8


@dataclass(frozen=True)
class Limits:
    """The limits of one frontend: ``[limits]``, and ``max_inputs`` resolved per model."""

    config: LimitsConfig = field(default_factory=LimitsConfig)
    inputs: dict[str, int] = field(default_factory=dict)  # model name -> max_inputs

    @classmethod
    def from_settings(cls, settings: FrontendSettings) -> Limits:
        return cls(settings.limits, {m.name: m.max_inputs for m in settings.models})

    def check_inputs(self, model: str, count: int, field: str, what: str = "inputs") -> None:
        """At most ``max_inputs`` pieces of work (prompts x n, inputs, documents) for one request."""
        limit = self.inputs.get(model) or self.config.max_inputs or _UNLISTED_INPUTS
        if count > limit:
            raise BadRequest(
                f"{count} {what} in one request; model {model!r} takes at most {limit} ([limits] max_inputs): "
                "split them over several requests",
                field=field,
            )

    def check_stop(self, stop: Any, field: str = "stop") -> None:
        """At most ``max_stop`` stop strings of ``max_stop_chars`` characters each (a type error is not ours)."""
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list):
            return
        c = self.config
        if len(stops) > c.max_stop:
            raise BadRequest(f"{len(stops)} stop strings; at most {c.max_stop} ([limits] max_stop)", field=field)
        longest = max((len(s) for s in stops if isinstance(s, str)), default=0)
        if longest > c.max_stop_chars:
            raise BadRequest(
                f"a stop string of {longest} characters; at most {c.max_stop_chars} ([limits] max_stop_chars)",
                field=field,
            )

    def check_logit_bias(self, bias: Any, field: str = "logit_bias") -> None:
        c = self.config
        if isinstance(bias, dict) and len(bias) > c.max_logit_bias:
            raise BadRequest(
                f"{len(bias)} logit_bias entries; at most {c.max_logit_bias} ([limits] max_logit_bias)", field=field
            )

    def check_tools(self, tools: Any, field: str = "tools") -> None:
        """At most ``max_tools`` tools, and their parameter schemas together within the schema limits."""
        if not isinstance(tools, list):
            return
        c = self.config
        if len(tools) > c.max_tools:
            raise BadRequest(f"{len(tools)} tools; at most {c.max_tools} ([limits] max_tools)", field=field)
        self.check_schema(tools, field)

    def check_schema(self, schema: Any, field: str) -> None:
        """A JSON schema (an object, or its JSON text) within ``max_schema_bytes``, ``max_schema_depth`` and
        ``max_schema_properties``. Text that is not JSON is left to the grammar's own error."""
        c = self.config
        if isinstance(schema, str):
            size = len(schema.encode())
            if size <= c.max_schema_bytes:
                try:
                    schema = msgspec.json.decode(schema)
                except (msgspec.DecodeError, RecursionError):
                    return
        else:
            size = len(msgspec.json.encode(schema))
        if size > c.max_schema_bytes:
            raise BadRequest(
                f"a schema of {size} bytes; at most {c.max_schema_bytes} ([limits] max_schema_bytes)", field=field
            )
        depth, properties = schema_shape(schema, c.max_schema_depth)
        if depth > c.max_schema_depth:
            raise BadRequest(
                f"a schema nested more than {c.max_schema_depth} levels deep ([limits] max_schema_depth)", field=field
            )
        if properties > c.max_schema_properties:
            raise BadRequest(
                f"a schema with {properties} object properties; at most {c.max_schema_properties} "
                "([limits] max_schema_properties)",
                field=field,
            )


def schema_shape(value: Any, max_depth: int) -> tuple[int, int]:
    """(nesting depth of objects and arrays, keys of every ``properties`` table) of parsed JSON; the walk stops
    one level past ``max_depth`` (that depth is reported) and is iterative, so any nesting is safe."""
    depth = properties = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            children = node.values()
            inner = node.get("properties")
            if isinstance(inner, dict):
                properties += len(inner)
        elif isinstance(node, list):
            children = node
        else:
            continue
        depth = max(depth, level)
        if level > max_depth:
            return depth, properties
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return depth, properties

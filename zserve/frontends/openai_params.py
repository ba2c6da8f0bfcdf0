"""OpenAI request bodies to what the engine takes: the sampling options of ``/v1/completions`` and
``/v1/chat/completions`` checked and translated into ``GenerateRequest`` fields, structured output, the chat
history and tools. Pure functions: a bad field raises ``BadRequest`` naming it (the routes answer 400 in
OpenAI's shape), before anything reaches the broker."""

from __future__ import annotations

from typing import Any

import msgspec

from zserve.errors import BadRequest
from zserve.frontends import tool_calls
from zserve.generator.options import default_max_running
from zserve.generator.schema_check import unenforceable
from zserve.model import Model

_json = msgspec.json.Encoder()

# OpenAI fields that would change the output and that we do not implement: refused, never ignored.
_UNSUPPORTED = {"suffix": None}
_MAX_LOGPROBS = 20  # as vLLM's default max_logprobs (OpenAI's own limits: 20 for chat, 5 for completions)


def sampling_options(body: dict[str, Any], default_max_tokens: int | None, max_n: int) -> dict[str, Any]:
    """The GenerateRequest fields (less prompt/messages) for an OpenAI body, with vLLM's extensions
    (``ignore_eos``, ``min_tokens``, ``top_k``, ``stop_token_ids``, ``repetition_penalty``)."""
    for name, neutral in _UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value != neutral:
            raise BadRequest(f"`{name}` is not supported by this server", field=name)
    n = body.get("n") or 1
    if n > max_n:
        raise BadRequest(f"n={n} is more than this model's engine runs at once ({max_n})", field="n")
    if body.get("best_of") not in (None, n):
        raise BadRequest("best_of is only supported equal to n", field="best_of")
    sampling: dict[str, Any] = {}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", default_max_tokens))
    if max_tokens is not None:
        sampling["max_new_tokens"] = max_tokens
    temperature = body.get("temperature")
    sampling["temperature"] = 1.0 if temperature is None else temperature  # OpenAI's default is 1, not greedy
    for ours, theirs in (("top_p", "top_p"), ("seed", "seed"), ("ignore_eos", "ignore_eos"),
                         ("min_new_tokens", "min_tokens"), ("stop_token_ids", "stop_token_ids"),
                         ("presence_penalty", "presence_penalty"), ("frequency_penalty", "frequency_penalty"),
                         ("repetition_penalty", "repetition_penalty"), ("logit_bias", "logit_bias")):  # fmt: skip
        if body.get(theirs) is not None:
            sampling[ours] = body[theirs]
    top_k = body.get("top_k")
    if top_k is not None:
        sampling["top_k"] = 0 if top_k == -1 else top_k  # vLLM spells "off" as -1
    stop = body.get("stop")
    if stop is not None:
        sampling["stop"] = [stop] if isinstance(stop, str) else stop
    sampling.update(structured(body))
    return sampling


def structured(body: dict[str, Any]) -> dict[str, Any]:
    """``response_format`` (text, json_object, json_schema) or vLLM's ``guided_json`` as GenerateRequest's
    ``json_object`` / ``json_schema`` (the schema as JSON text, compiled by the engine)."""
    guided = body.get("guided_json")
    if guided is not None:
        if isinstance(guided, str):
            try:
                _enforceable(msgspec.json.decode(guided), "guided_json")
            except msgspec.DecodeError:
                raise BadRequest("guided_json is not JSON", field="guided_json") from None
            return {"json_schema": guided}
        _enforceable(guided, "guided_json")
        return {"json_schema": _json.encode(guided).decode()}
    fmt = body.get("response_format")
    if fmt is None:
        return {}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema") if isinstance(fmt.get("json_schema"), dict) else None
        if not isinstance(schema, dict):
            raise BadRequest("response_format json_schema needs json_schema.schema, an object", field="response_format")
        _enforceable(schema, "response_format")
        return {"json_schema": _json.encode(schema).decode()}
    raise BadRequest("response_format.type must be text, json_object or json_schema", field="response_format")


def _enforceable(schema: Any, field: str) -> None:
    """A schema the grammar cannot enforce is refused here, not accepted and left unenforced."""
    why = unenforceable(schema)
    if why is not None:
        raise BadRequest(f"the JSON schema cannot be enforced: {why}", field=field)


def logprobs_count(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_LOGPROBS:
        raise BadRequest(f"`{field}` must be an integer from 0 to {_MAX_LOGPROBS}", field=field)
    return value


def choices(items: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """Each prompt's ``n`` choices, each its own sequence (they share the prompt's KV blocks through the
    prefix cache once computed); a seed gives choice j the seed + j, so every choice is reproducible."""
    if n == 1:
        return items
    out = []
    for item in items:
        seed = item.get("seed")
        out += [item if seed is None else {**item, "seed": seed + j} for j in range(n)]
    return out


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI messages (content as a string, or a list of text parts) as {role, content} (with an
    assistant's ``tool_calls``, a tool message's ``tool_call_id``, a ``name``, when given)."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("`messages` must be a non-empty list of {role, content}", field="messages")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest("each message needs a `role` and a `content`", field="messages")
        content = m.get("content") or ""
        if isinstance(content, list):
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise BadRequest("only text content parts are supported", field="messages")
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(content, str):
            raise BadRequest("message content must be a string or text parts", field="messages")
        out.append({"role": m["role"], "content": content,
                    **{k: m[k] for k in ("tool_calls", "tool_call_id", "name") if m.get(k) is not None}})  # fmt: skip
    return tool_calls.check_history(out)


def max_running(model: Model) -> int:
    """The model's ``max_running`` option, else its default (GeneratorOptions', the one definition)."""
    return int(model.options.get("max_running", default_max_running()))


def tooling(body: dict[str, Any]) -> tuple[list[tool_calls.Function], str | tool_calls.Function, bool] | None:
    """A chat body's tools, its tool_choice and parallel_tool_calls, checked; None without tools."""
    tools = body.get("tools")
    if tools is None:
        tool_calls.check_tool_choice(body.get("tool_choice"), [])  # a choice other than none needs tools
        return None
    functions = tool_calls.check_tools(tools)
    choice = tool_calls.check_tool_choice(body.get("tool_choice"), functions)
    forced = [choice] if isinstance(choice, tool_calls.Function) else functions if choice == "required" else []
    for f in forced:  # the grammar will enforce these schemas: each must be one it can
        why = unenforceable(f.parameters)
        if why is not None:
            raise BadRequest(f"tool {f.name!r}: its parameters cannot be enforced: {why}", field="tools")
    return functions, choice, body.get("parallel_tool_calls") is not False


def tool_parser(model: Model) -> str:
    """The model's ``tool_parser`` option; ``auto``: by its chat template (read from its files: call it once
    per model, not per request), hermes if unknown."""
    choice = str(model.options.get("tool_parser", "auto"))
    if choice != "auto":
        return choice
    read = getattr(model, "chat_template", None)
    return tool_calls.parser_for_template(read() if read else None)

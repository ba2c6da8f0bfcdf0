"""OpenAI request bodies to what the engine takes: a typed ``/v1/completions`` or ``/v1/chat/completions`` body
(``zserve.frontends.api_types``, decoded once with its ranges) mapped into ``GenerateRequest``s (vLLM's
``to_sampling_params``), with structured output, the chat history and tools checked. Pure functions: a bad
field raises ``BadRequest`` naming it (the routes answer 400 in OpenAI's shape), before anything reaches the
broker."""

from __future__ import annotations

from typing import Any

import msgspec

from zserve.errors import BadRequest
from zserve.frontends import tool_calls
from zserve.frontends.api_types import ChatCompletionRequest, ChatMessageIn, CompletionRequest
from zserve.generation import MAX_LOGPROBS, ChatMessage, GenerateRequest
from zserve.generator.options import default_max_running
from zserve.generator.schema_check import unenforceable
from zserve.model import Model

_json = msgspec.json.Encoder()

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for completions (chat: the model's own)

# (GenerateRequest's name, the OpenAI body's) of the fields that pass as they are when given
_SAME = (("top_p", "top_p"), ("seed", "seed"), ("ignore_eos", "ignore_eos"), ("min_new_tokens", "min_tokens"),
         ("stop_token_ids", "stop_token_ids"), ("presence_penalty", "presence_penalty"),
         ("frequency_penalty", "frequency_penalty"), ("repetition_penalty", "repetition_penalty"),
         ("logit_bias", "logit_bias"))  # fmt: skip


def completion_requests(body: CompletionRequest, max_n: int) -> list[GenerateRequest]:
    """One ``GenerateRequest`` per prompt of a completions body (its ``n`` choices: ``choices``)."""
    if body.suffix is not None:
        raise BadRequest("`suffix` is not supported by this server", field="suffix")
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if not prompts:
        raise BadRequest("`prompt` must be a string or a list of strings", field="prompt")
    sampling = _sampling(body, COMPLETIONS_MAX_TOKENS, max_n)
    if body.logprobs is not None and body.logprobs is not False:
        sampling["logprobs"] = logprobs_count(body.logprobs, "logprobs")
        if body.echo:  # the prompt's tokens are reported too, as OpenAI's legacy API did
            sampling["prompt_logprobs"] = sampling["logprobs"]
    return [GenerateRequest(prompt=p, **sampling) for p in prompts]


def chat_request(body: ChatCompletionRequest, max_n: int) -> GenerateRequest:
    """The ``GenerateRequest`` of a chat body: its history, its tools (a forced ``tool_choice`` as the grammar's
    schema), its sampling options."""
    sampling = _sampling(body, None, max_n)  # None: the model's default
    if body.logprobs:
        sampling["logprobs"] = logprobs_count(body.top_logprobs or 0, "top_logprobs")
    elif body.top_logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", field="top_logprobs")
    messages = chat_messages(body.messages)
    tools = tooling(body)
    if tools is not None:
        functions, choice, parallel, definitions = tools
        schema = tool_calls.forced_schema(choice, functions, parallel)
        if schema is not None:
            if "json_schema" in sampling or "json_object" in sampling:
                raise BadRequest("a forced tool_choice (required or a function) with response_format",
                                 field="tool_choice")  # fmt: skip
            sampling["json_schema"] = _json.encode(schema).decode()
        sampling["tools"] = definitions
    return GenerateRequest(messages=messages, **sampling)


def _sampling(body: CompletionRequest | ChatCompletionRequest, default_max_tokens: int | None,
              max_n: int) -> dict[str, Any]:  # fmt: skip
    """The GenerateRequest fields (less prompt/messages) of an OpenAI body, with vLLM's extensions (``ignore_eos``,
    ``min_tokens``, ``top_k``, ``stop_token_ids``, ``repetition_penalty``). The body's decode checked the ranges
    (GenerateRequest's own); what is left is what a range cannot say."""
    n = body.n or 1
    if n > max_n:
        raise BadRequest(f"n={n} is more than this model's engine runs at once ({max_n})", field="n")
    if body.best_of not in (None, n):
        raise BadRequest("best_of is only supported equal to n", field="best_of")
    sampling: dict[str, Any] = {ours: getattr(body, theirs) for ours, theirs in _SAME
                                if getattr(body, theirs) is not None}  # fmt: skip
    # the first given, null included (null: the model's own limit); neither given: the route's default
    given = [m for m in (body.max_completion_tokens, body.max_tokens) if m is not msgspec.UNSET]
    max_tokens = given[0] if given else default_max_tokens
    if max_tokens is not None:
        sampling["max_new_tokens"] = max_tokens
    sampling["temperature"] = 1.0 if body.temperature is None else body.temperature  # OpenAI's default is 1
    if body.top_k is not None:
        sampling["top_k"] = 0 if body.top_k == -1 else body.top_k  # vLLM spells "off" as -1
    if body.stop is not None:
        sampling["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
    sampling.update(structured(body))
    return sampling


def structured(body: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    """``response_format`` (text, json_object, json_schema) or vLLM's ``guided_json`` as GenerateRequest's
    ``json_object`` / ``json_schema`` (the schema as JSON text, compiled by the engine)."""
    guided = body.guided_json
    if guided is not None:
        if isinstance(guided, str):
            try:
                _enforceable(msgspec.json.decode(guided), "guided_json")
            except msgspec.DecodeError:
                raise BadRequest("guided_json is not JSON", field="guided_json") from None
            return {"json_schema": guided}
        _enforceable(guided, "guided_json")
        return {"json_schema": _json.encode(guided).decode()}
    fmt = body.response_format
    if fmt is None:
        return {}
    kind = fmt.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
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
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise BadRequest(f"`{field}` must be an integer from 0 to {MAX_LOGPROBS}", field=field)
    return value


def choices(requests: list[GenerateRequest], n: int) -> list[GenerateRequest]:
    """Each prompt's ``n`` choices, each its own sequence (they share the prompt's KV blocks through the
    prefix cache once computed); a seed gives choice j the seed + j, so every choice is reproducible."""
    if n == 1:
        return requests
    out = []
    for r in requests:
        out += [r if r.seed is None else msgspec.structs.replace(r, seed=r.seed + j) for j in range(n)]
    return out


def chat_messages(messages: list[ChatMessageIn]) -> list[ChatMessage]:
    """OpenAI messages (content as a string, or text parts) as the chat template takes them: {role, content},
    with an assistant's ``tool_calls`` (arguments as JSON values), a tool message's ``tool_call_id``, a
    ``name``, when given."""
    out = []
    for m in messages:
        content = m.content or ""
        if not isinstance(content, str):
            content = "".join(p.text for p in content)
        out.append({"role": m.role, "content": content,
                    **{k: msgspec.to_builtins(v) for k in ("tool_calls", "tool_call_id", "name")
                       if (v := getattr(m, k)) is not None}})  # fmt: skip
    return [ChatMessage(**m) for m in tool_calls.check_history(out)]


def max_running(model: Model) -> int:
    """The model's ``max_running`` option, else its default (GeneratorOptions', the one definition)."""
    return int(model.options.get("max_running", default_max_running()))


def tooling(
    body: ChatCompletionRequest,
) -> tuple[list[tool_calls.Function], str | tool_calls.Function, bool, list[dict[str, Any]]] | None:
    """A chat body's tools (checked), its tool_choice and parallel_tool_calls, and the tools as the chat template
    takes them; None without tools."""
    choice = None if body.tool_choice is None else msgspec.to_builtins(body.tool_choice)
    if body.tools is None:
        tool_calls.check_tool_choice(choice, [])  # a choice other than none needs tools
        return None
    definitions = msgspec.to_builtins(body.tools)
    functions = tool_calls.check_tools(definitions)
    choice = tool_calls.check_tool_choice(choice, functions)
    forced = [choice] if isinstance(choice, tool_calls.Function) else functions if choice == "required" else []
    for f in forced:  # the grammar will enforce these schemas: each must be one it can
        why = unenforceable(f.parameters)
        if why is not None:
            raise BadRequest(f"tool {f.name!r}: its parameters cannot be enforced: {why}", field="tools")
    return functions, choice, body.parallel_tool_calls is not False, definitions


def tool_parser(model: Model) -> str:
    """The model's ``tool_parser`` option; ``auto``: by its chat template (read from its files: call it once
    per model, not per request), hermes if unknown."""
    choice = str(model.options.get("tool_parser", "auto"))
    if choice != "auto":
        return choice
    read = getattr(model, "chat_template", None)
    return tool_calls.parser_for_template(read() if read else None)

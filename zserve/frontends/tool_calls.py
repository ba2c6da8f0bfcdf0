"""Tool calling on /v1/chat/completions, as pure functions: the request's ``tools``/``tool_choice`` checked,
the grammar that forces a call, and the parsers that turn a model's text into OpenAI ``tool_calls``.

What each ``tool_choice`` does (vLLM's behaviour):

* ``none``: the tools are rendered by the chat template, the output is plain content, never parsed.
* ``auto``: the model writes in its own tool-call format and a parser per family splits its text into content
  and calls: ``hermes`` (Qwen2.5/Qwen3, Hermes, most templates): ``<tool_call>{"name", "arguments"}</tool_call>``,
  any number of them; ``llama3`` (Llama 3.1-3.3 JSON tool calling): the whole output is
  ``{"name", "parameters"}`` objects (an optional ``<|python_tag|>`` first, ``;`` between them).
* ``required``: the grammar forces a JSON array of ``{"name", "parameters"}`` objects, one per call, each
  ``parameters`` following its function's schema (at most one item without ``parallel_tool_calls``).
* a named function: the grammar forces that function's arguments (a JSON value of its ``parameters`` schema).

Streaming: one ``ToolCallStream`` per choice is fed the generated text as it comes and answers pieces (content
text, or a call's first delta with its id and name, then its arguments). The whole answer is the same stream
fed at once, so streamed deltas always reassemble into the non-streamed answer. A call goes out when it is
complete (its closing tag, or the end of the output), its arguments in one delta after its name; content
text goes out as it comes, except the whitespace just before a call or at the end, which is dropped.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from zserve.errors import BadRequest

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function name
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class Function:
    name: str
    parameters: dict[str, Any]  # its JSON schema (an object schema)


@dataclass(frozen=True)
class Piece:
    """What a stream answers: ``content`` text, or a part of call number ``index``: its first piece has its
    ``id`` and ``name`` (and empty arguments), the next ones ``arguments`` text."""

    content: str | None = None
    index: int = 0
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---- the request ----


def check_tools(tools: Any) -> list[Function]:
    """OpenAI's ``tools`` (``[{"type": "function", "function": {"name", "description", "parameters"}}]``) as
    Functions; a malformed tool or an invalid parameters schema is a BadRequest naming ``tools``."""
    if not isinstance(tools, list):
        raise BadRequest("`tools` must be a list of {type: function, function: {...}}", field="tools")
    out: dict[str, Function] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise BadRequest(f"tools[{i}] must be {{type: function, function: {{name, parameters}}}}", field="tools")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise BadRequest(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -", field="tools")
        if name in out:
            raise BadRequest(f"two tools are named {name!r}", field="tools")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        _check_schema(parameters, f"tools[{i}].function.parameters")
        out[name] = Function(name, parameters)
    return list(out.values())


def _check_schema(schema: Any, where: str) -> None:
    if not isinstance(schema, dict):
        raise BadRequest(f"{where} must be a JSON schema object", field="tools")
    if schema.get("type", "object") != "object":
        raise BadRequest(f"{where} must describe an object (type: object)", field="tools")
    error = _schema_error(json.dumps(schema, sort_keys=True))
    if error is not None:
        raise BadRequest(f"{where} is not a valid JSON schema: {error}", field="tools")


@functools.lru_cache(maxsize=256)
def _schema_error(schema_json: str) -> str | None:
    """jsonschema's complaint about a schema (JSON text), or None. Cached: a check costs ~1 ms, and agent
    loops send the same tools on every turn."""
    try:
        from jsonschema import exceptions, validators
    except ImportError:  # not a dependency: the grammar compiler still refuses what it cannot compile
        return None
    schema = json.loads(schema_json)
    try:
        validators.validator_for(schema).check_schema(schema)
    except exceptions.SchemaError as exc:
        return exc.message
    return None


def check_tool_choice(choice: Any, functions: list[Function]) -> str | Function:
    """``none`` | ``auto`` | ``required``, or the named Function. Default: auto with tools, none without."""
    if choice is None:
        return "auto" if functions else "none"
    if choice in ("none", "auto", "required"):
        if choice != "none" and not functions:
            raise BadRequest(f"tool_choice {choice!r} needs `tools`", field="tool_choice")
        return choice
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(function, dict):
        raise BadRequest('tool_choice must be none, auto, required or {"type": "function", "function": {"name"}}',
                         field="tool_choice")  # fmt: skip
    for f in functions:
        if f.name == function.get("name"):
            return f
    raise BadRequest(f"tool_choice names {function.get('name')!r}, which is not in `tools`", field="tool_choice")


def check_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: an assistant's ``tool_calls`` with their arguments as
    JSON values (templates write them with ``tojson``), each ``tool`` message answering an earlier call by
    its ``tool_call_id`` (else a BadRequest naming ``messages``)."""
    called: set[str] = set()
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        calls = m.get("tool_calls")
        if calls is not None:
            if m.get("role") != "assistant" or not isinstance(calls, list):
                raise BadRequest(f"messages[{i}].tool_calls: only an assistant message has a list of them",
                                 field="messages")  # fmt: skip
            m["tool_calls"] = [_history_call(i, c) for c in calls]
            called.update(c["id"] for c in m["tool_calls"])
        if m.get("role") == "tool":
            call_id = m.get("tool_call_id")
            if call_id not in called:
                raise BadRequest(f"messages[{i}] (role tool) answers tool_call_id {call_id!r}, which no earlier "
                                 "assistant message called", field="messages")  # fmt: skip
        out.append(m)
    return out


def _history_call(i: int, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if (
        not isinstance(function, dict)
        or not isinstance(call.get("id"), str)
        or not isinstance(function.get("name"), str)
    ):
        raise BadRequest(f"messages[{i}].tool_calls: each needs an id and a function {{name, arguments}}",
                         field="messages")  # fmt: skip
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # not JSON, or nested past the interpreter's limit
            pass  # rendered as the text it is
    return {"id": call["id"], "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def forced_schema(choice: str | Function, functions: list[Function], parallel: bool) -> dict[str, Any] | None:
    """The JSON schema the output must follow: a named function's arguments, or for ``required`` an array
    of ``{"name", "parameters"}`` calls (vLLM's shape); None when nothing is forced."""
    if isinstance(choice, Function):
        return choice.parameters
    if choice != "required":
        return None
    items = [{"type": "object", "properties": {"name": {"const": f.name}, "parameters": f.parameters},
              "required": ["name", "parameters"], "additionalProperties": False} for f in functions]  # fmt: skip
    schema: dict[str, Any] = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items},
                              "minItems": 1}  # fmt: skip
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parser_for_template(template: str | None) -> str:
    """The parser family a chat template's tool-call format calls for: ``hermes`` unless it writes Llama 3's
    JSON calls (``<|python_tag|>`` or ``"parameters"`` without ``<tool_call>``)."""
    if template and _OPEN not in template and (_PYTHON_TAG in template or '"parameters"' in template):
        return "llama3"
    return "hermes"


# ---- the output ----


class ToolCallStream:
    """A choice's generated text, fed as it comes, as content and tool-call pieces. ``mode``: ``hermes`` or
    ``llama3`` (auto), ``required`` or ``named`` (forced by the grammar; ``name`` the named function)."""

    def __init__(self, mode: str, *, name: str = "", parallel: bool = True) -> None:
        if mode not in ("hermes", "llama3", "required", "named"):
            raise ValueError(f"unknown tool-call mode {mode!r}")
        self.mode, self.name, self.parallel = mode, name, parallel
        self.calls = 0  # calls answered so far
        self._buffer = ""  # text not answered yet
        self._space = ""  # whitespace held back (dropped before a call or at the end)
        self._decided = self._is_calls = False  # llama3: whether the output is calls (starts with `{`)
        self._close_from = 0  # hermes: where in the buffer (an open call) `</tool_call>` may start

    def feed(self, text: str) -> list[Piece]:
        if self.mode == "named":
            return self._named(text)
        self._buffer += text
        if self.mode == "required":
            return []
        if self.mode == "llama3":
            return self._llama3(final=False)
        return self._hermes(final=False)

    def finish(self) -> list[Piece]:
        """What the end of the output releases (the buffered calls, held text)."""
        if self.mode == "named":
            return [] if self.calls else self._named("")
        if self.mode == "required":
            return self._required()
        if self.mode == "llama3":
            return self._llama3(final=True)
        return self._hermes(final=True)

    # forced

    def _named(self, text: str) -> list[Piece]:
        out = [] if self.calls else [Piece(index=0, id=new_call_id(), name=self.name, arguments="")]
        self.calls = 1
        return out + ([Piece(index=0, arguments=text)] if text else [])

    def _required(self) -> list[Piece]:
        text, self._buffer = self._buffer, ""
        try:
            calls = json.loads(text)
            found = [(c["name"], c["parameters"]) for c in calls]
        except (ValueError, TypeError, KeyError):  # cut by max_tokens: not a whole array yet
            return [Piece(content=text)] if text else []
        return self._calls(found)

    # auto

    def _hermes(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        while True:
            start = self._buffer.find(_OPEN)
            if start < 0:
                keep = 0 if final else _partial_tag(self._buffer)
                out += self._content(self._buffer[: len(self._buffer) - keep], final)
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return out
            out += self._content(self._buffer[:start], False)  # its trailing whitespace held: a call drops it
            end = self._buffer.find(_CLOSE, max(start, self._close_from))
            if end < 0 and not final:  # a call is open: the next text is searched from here on, not again
                self._buffer = self._buffer[start:]
                self._close_from = max(0, len(self._buffer) - len(_CLOSE) + 1)
                return out
            self._close_from = 0
            body = self._buffer[start + len(_OPEN) : end if end >= 0 else len(self._buffer)]
            rest = self._buffer[end + len(_CLOSE) :] if end >= 0 else ""
            call = _json_call(body, ("arguments", "parameters"))
            if call is None:  # not a call after all: the text stays content, as it was written
                out += self._content(self._buffer[start : len(self._buffer) - len(rest)], final and not rest)
            else:
                self._space = ""
                out += self._calls([call])
            self._buffer = rest
            if not rest:
                return out

    def _llama3(self, final: bool) -> list[Piece]:
        if not self._decided:  # calls only if the output starts with `{` (after an optional <|python_tag|>)
            head = self._buffer.lstrip()
            head = head[len(_PYTHON_TAG) :].lstrip() if head.startswith(_PYTHON_TAG) else head
            if not final and _PYTHON_TAG.startswith(head):
                return []  # only whitespace or part of the tag so far
            self._decided, self._is_calls = True, head.startswith("{")
        text = self._buffer
        if not self._is_calls:
            self._buffer = ""
            return self._content(text, final)
        if not final:
            return []
        self._buffer = ""
        calls = _llama3_calls(text)
        return self._content(text, True) if calls is None else self._calls(calls)

    # shared

    def _content(self, text: str, final: bool) -> list[Piece]:
        """Content text, its trailing whitespace held until more content follows (``final``: the text ends
        here, before a call or the end, and the held whitespace is dropped)."""
        text = self._space + text
        body = text.rstrip()
        self._space = "" if final else text[len(body) :]
        return [Piece(content=body)] if body else []

    def _calls(self, calls: list[tuple[str, Any]]) -> list[Piece]:
        out = []
        for name, arguments in calls:
            if self.calls and not self.parallel:
                break  # parallel_tool_calls false: the first call only
            text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
            out += [Piece(index=self.calls, id=new_call_id(), name=name, arguments=""),
                    Piece(index=self.calls, arguments=text)]  # fmt: skip
            self.calls += 1
        return out


def _partial_tag(text: str) -> int:
    """How many of ``text``'s last characters could begin ``<tool_call>`` (held until the next text)."""
    for n in range(min(len(_OPEN) - 1, len(text)), 0, -1):
        if _OPEN.startswith(text[-n:]):
            return n
    return 0


def _json_call(text: str, keys: tuple[str, str]) -> tuple[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return _call_of(value, keys)


def _call_of(value: Any, keys: tuple[str, str]) -> tuple[str, Any] | None:
    """(name, arguments) of a ``{"name", <keys[0]> or <keys[1]>}`` object (arguments an object, or JSON text)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(keys[0], value.get(keys[1], {}))
    return (value["name"], arguments) if isinstance(arguments, dict | str) else None


def _llama3_calls(text: str) -> list[tuple[str, Any]] | None:
    """Llama 3's JSON calls: ``[<|python_tag|>]{"name", "parameters"}[; {...}]*``, the whole text; else None."""
    text = text.strip()
    if text.startswith(_PYTHON_TAG):
        text = text[len(_PYTHON_TAG) :]
    decoder, at, calls = json.JSONDecoder(), 0, []
    while True:
        while at < len(text) and (text[at].isspace() or (calls and text[at] == ";")):
            at += 1
        if at == len(text):
            return calls or None
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        call = _call_of(value, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)


def whole(stream: ToolCallStream, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole output as (content or None, OpenAI tool_calls): the stream fed all of it at once."""
    pieces = stream.feed(text) + stream.finish()
    content = "".join(p.content for p in pieces if p.content is not None)
    calls: list[dict[str, Any]] = []
    for p in pieces:
        if p.id is not None:
            calls.append({"id": p.id, "type": "function", "function": {"name": p.name, "arguments": ""}})
        elif p.arguments is not None:
            calls[p.index]["function"]["arguments"] += p.arguments
    return (content or None), calls

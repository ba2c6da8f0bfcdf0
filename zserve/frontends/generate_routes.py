"""Generation over HTTP: OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions`` (with
``stream: true`` as Server-Sent Events) and DeepSpeed-MII's ``/mii/{deployment}``.

Each route decodes its body once into its typed Struct (``zserve.frontends.api_types``, the ranges
``GenerateRequest``'s) and maps that into ``GenerateRequest``s (``openai_params``, ``_mii_requests``), here, in the
frontend, so a bad field is a 400 before anything reaches the broker; the requests travel as they are (msgpack) to
the engine, which decodes them with their type. Errors on
the OpenAI routes come in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import falcon
import falcon.asgi
import msgspec

from zserve.client import AsyncClient, AsyncGenerationStream
from zserve.client.aio import gather_or_cancel
from zserve.errors import BadRequest, ZserveError
from zserve.frontends import metrics, openai_logprobs, openai_params, tool_calls
from zserve.frontends.api_types import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessageOut,
    Completion,
    CompletionChoice,
    CompletionRequest,
    FunctionCall,
    FunctionCallDelta,
    MiiRequest,
    OpenAIError,
    OpenAIErrorDetail,
    ToolCall,
    ToolCallDelta,
    Usage,
    decode_body,
)
from zserve.frontends.limits import Limits
from zserve.frontends.resources import (
    RequestError,
    answer_error,
    openai_error,
    priority_and_tenant,
    read_json,
    set_error,
)
from zserve.generation import GenerateRequest, GenerateResponse, TokenLogprob
from zserve.model import Model

_json = msgspec.json.Encoder()


@dataclass
class _ChoiceState:
    """What a route keeps per choice while answering: the text it starts with (completions' ``echo``), its
    tool-call parser (chat with tools), whether a streamed chunk went out yet, its streamed logprobs."""

    prefix: str = ""
    tools: tool_calls.ToolCallStream | None = None
    started: bool = False
    announce: bool = False  # stream a first (role) chunk even without text: n > 1
    # completions' echo: every logprob with the last chunk, the prompt's first (they are known only whole)
    whole_logprobs: bool = False
    held: list[TokenLogprob] = field(default_factory=list)  # logprobs received, not yet in a chunk
    logprobs_out: int = 0  # logprobs that went out in chunks
    text_out: int = 0  # characters of the choice's text that went out in chunks (completions' text_offset)

    def hold(self, tokens: list[TokenLogprob]) -> None:
        if not self.whole_logprobs:
            self.held += tokens

    def chunk_logprobs(self, tokens: list[TokenLogprob], end: GenerateResponse | None) -> list[TokenLogprob] | None:
        """The logprobs the next chunk carries: its tokens' and those held back; with the last chunk
        (``end``) every one that has not gone out. None when there are none or they were not asked."""
        self.hold(tokens)
        if end is not None and end.logprobs is not None:
            out = end.logprobs[self.logprobs_out :]
        elif end is None and self.held:
            out = self.held
        else:
            return None
        self.held = []
        self.logprobs_out += len(out)
        return out or None


class _GenerateRoute:
    """What every generation route shares: the generative models, body reading, metrics."""

    def __init__(
        self, client: AsyncClient, handlers: dict[str, Model], max_body_bytes: int, limits: Limits | None = None
    ) -> None:
        self.client = client
        self.models = {name: h for name, h in handlers.items() if h.generative}
        self.max_body_bytes = max_body_bytes
        self.limits = limits or Limits()
        self.metrics = {name: metrics.ModelMetrics(name) for name in self.models}

    def _model(self, name: Any) -> Model:
        if not isinstance(name, str) or not name:
            raise BadRequest("`model` is required", field="model")
        model = self.models.get(name)
        if model is None:
            raise RequestError(404, "model_not_found", f"no generative model named {name!r}; see GET /v1/models",
                               "model")  # fmt: skip
        return model

    async def _answer(
        self,
        resp: falcon.asgi.Response,
        write_error: Callable[..., None],
        work: Callable[[list[str]], Awaitable[None]],
    ) -> None:
        """Run ``work`` (it appends the model's name once known), turn errors into responses, count it."""
        started = time.perf_counter()
        code, named = 200, []
        try:
            await work(named)
        except Exception as exc:
            code = answer_error(resp, exc, write_error)
        finally:
            if named and named[0] in self.metrics:
                self.metrics[named[0]].answered(code, time.perf_counter() - started)

    async def _run(self, name: str, item: Any, priority: int = 0, tenant: str = "") -> GenerateResponse:
        answer = await self.client.infer(name, item, decoded=True, priority=priority, tenant=tenant)
        return msgspec.convert(answer.value, GenerateResponse)


class _OpenAIRoute(_GenerateRoute):
    object_name = ""  # "text_completion" | "chat.completion"
    chunk_object_name = ""  # what a streamed event's "object" says
    id_prefix = ""
    request_type: type = CompletionRequest  # the body's Struct: its fields' types and ranges (and /openapi.json's)
    answer_type: type = Completion
    chunk_type: type = Completion  # a streamed event's data

    def _requests(self, model: Model, body: Any) -> list[GenerateRequest]:
        raise NotImplementedError

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        async def work(named: list[str]) -> None:
            body = decode_body(await read_json(req, self.max_body_bytes), self.request_type)
            name = body.model
            model = self._model(name)
            named.append(name)
            self._check_limits(name, body)
            prompts = self._requests(model, body)
            items = openai_params.choices(prompts, body.n or 1)
            meta = {"id": f"{self.id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": name}
            n = len(items) // len(prompts)
            states = self._states(model, body, prompts, n)
            priority, tenant = priority_and_tenant(req, body.priority)
            try:
                if body.stream:
                    if len(prompts) != 1:
                        raise BadRequest("streaming takes one prompt per request", field="prompt")
                    usage = bool(body.stream_options and body.stream_options.include_usage)
                    streams = [
                        self.client.generate_stream(item, model=name, decoded=True, priority=priority, tenant=tenant)
                        for item in items
                    ]
                    try:  # an error before any text (a prompt the engine refuses) is an HTTP error, not an event
                        firsts = await gather_or_cancel([_first(s) for s in streams])
                    except BaseException:
                        for s in streams:
                            await s.aclose()
                        raise
                    resp.sse = self._stream(streams, firsts, states, meta, usage)
                    resp.set_header("Cache-Control", "no-cache")
                    return
                responses = await gather_or_cancel([self._run(name, item, priority, tenant) for item in items])
            except BadRequest as exc:
                raise self._refused(body, exc) from None
            resp.data = _json.encode(self._completion(meta, responses, states, n))
            resp.content_type = falcon.MEDIA_JSON

        await self._answer(resp, openai_error, work)

    def _refused(self, body: Any, exc: BadRequest) -> BadRequest:
        """The engine's refusal as the client should read it (chat: a tool schema it cannot compile)."""
        return exc

    def _check_limits(self, name: str, body: CompletionRequest | ChatCompletionRequest) -> None:
        """``[limits]`` on a decoded body, before any prompt is tokenised or schema checked."""
        limits = self.limits
        prompt = getattr(body, "prompt", None)
        prompts = len(prompt) if isinstance(prompt, list) else 1
        n = body.n or 1
        what = f"sequences ({prompts} prompts x n={n})"
        limits.check_inputs(name, prompts * n, "prompt" if prompts > 1 else "n", what)
        limits.check_stop(body.stop)
        limits.check_logit_bias(body.logit_bias)
        tools = getattr(body, "tools", None)
        limits.check_tools(None if tools is None else msgspec.to_builtins(tools))
        fmt = body.response_format
        spec = fmt.get("json_schema") if isinstance(fmt, dict) else None
        if isinstance(spec, dict) and spec.get("schema") is not None:
            limits.check_schema(spec["schema"], "response_format")
        if body.guided_json is not None:
            limits.check_schema(body.guided_json, "guided_json")

    def _states(self, model: Model, body: Any, prompts: list[GenerateRequest], n: int) -> list[_ChoiceState]:
        """Each choice's state (completions' ``echo``: its prompt as prefix)."""
        return [_ChoiceState(announce=n > 1) for _ in range(len(prompts) * n)]

    def _completion(self, meta: dict[str, Any], responses: list[GenerateResponse], states: list[_ChoiceState],
                    n: int) -> Any:  # fmt: skip
        # usage: each prompt once (as OpenAI and vLLM count it; its n choices share it), every choice's tokens
        prompt_tokens = sum(r.prompt_length for r in responses[::n])
        completion_tokens = sum(r.generated_length for r in responses)
        choices = [self._choice(i, r, states[i]) for i, r in enumerate(responses)]
        return self.answer_type(**meta, object=self.object_name, choices=choices,
                                usage=_usage(prompt_tokens, completion_tokens))  # fmt: skip

    def _choice(self, index: int, response: GenerateResponse, state: _ChoiceState) -> Any:
        raise NotImplementedError

    def _delta(self, index: int, text: str | None, state: _ChoiceState, logprobs: list[TokenLogprob] | None,
               end: GenerateResponse | None) -> Any:  # fmt: skip
        """A streamed chunk's choice, with the logprobs of its tokens; ``end``: the choice's whole response,
        with its last chunk."""
        raise NotImplementedError

    def _deltas(self, index: int, text: str, tokens: list[TokenLogprob], end: GenerateResponse | None,
                state: _ChoiceState) -> list[Any]:  # fmt: skip
        """The chunk choices for a choice's new ``text`` (``tokens``: their logprobs, when asked) or its end:
        one, or none for a first chunk with nothing to say."""
        if not text and end is None and not state.started and not state.announce:
            state.hold(tokens)
            return []
        logprobs = state.chunk_logprobs(tokens, end)
        out = [self._delta(index, text if text or end is None else None, state, logprobs, end)]
        state.started = True
        state.text_out += len(text)
        return out

    def _event(self, meta: dict[str, Any], choices: list[Any], usage: Usage | None = None) -> falcon.asgi.SSEvent:
        chunk = self.chunk_type(**meta, object=self.chunk_object_name, choices=choices, usage=usage)
        return falcon.asgi.SSEvent(data=_json.encode(chunk))

    async def _stream(
        self,
        streams: list[AsyncGenerationStream],
        firsts: list[str | None],
        states: list[_ChoiceState],
        meta: dict[str, Any],
        usage: bool,
    ) -> AsyncIterator[Any]:
        """The choices' deltas as they come (each choice's first chunk carries the role, its last the
        finish_reason and, if asked, its logprobs), then usage, then ``[DONE]``."""
        news: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream: AsyncGenerationStream) -> None:
            try:
                async for text in stream:
                    news.put_nowait((index, (text, stream.delta_logprobs)))
                news.put_nowait((index, stream.response))
            except ZserveError as exc:
                news.put_nowait((index, exc))

        pumps: list[asyncio.Task] = []
        try:
            for i, (first, tokens) in enumerate(firsts):
                for choice in self._deltas(i, states[i].prefix + first, tokens, None, states[i]):
                    yield self._event(meta, [choice])
            pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
            ended: list[GenerateResponse] = []
            while len(ended) < len(streams):
                index, item = await news.get()
                if isinstance(item, ZserveError):
                    raise item
                if isinstance(item, tuple):
                    choices = self._deltas(index, *item, None, states[index])
                else:
                    ended.append(item)
                    choices = self._deltas(index, "", [], item, states[index])
                for choice in choices:
                    yield self._event(meta, [choice])
            if usage:
                completion_tokens = sum(r.generated_length for r in ended)
                yield self._event(meta, [], _usage(ended[0].prompt_length, completion_tokens))
        except ZserveError as exc:  # the status line is out already: the error travels as an event
            error = OpenAIError(OpenAIErrorDetail(exc.message, exc.type_name, exc.field or None, None))
            yield falcon.asgi.SSEvent(data=_json.encode(error))
        finally:
            for task in pumps:
                task.cancel()
            for stream in streams:
                await stream.aclose()  # the client went away mid-stream: cancel, free the KV blocks
        yield falcon.asgi.SSEvent(data=b"[DONE]")


async def _first(stream: AsyncGenerationStream) -> tuple[str, list[TokenLogprob]]:
    """A stream's first text and its tokens' logprobs; nothing when it finished without text."""
    try:
        return await anext(stream), stream.delta_logprobs
    except StopAsyncIteration:
        return "", []


def _usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


class CompletionsResource(_OpenAIRoute):
    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def _requests(self, model: Model, body: CompletionRequest) -> list[GenerateRequest]:
        return openai_params.completion_requests(body, openai_params.max_running(model))

    def _states(self, model: Model, body: CompletionRequest, prompts: list[GenerateRequest],
                n: int) -> list[_ChoiceState]:  # fmt: skip
        echo = bool(body.echo)
        return [_ChoiceState(prefix=p.prompt or "" if echo else "", announce=n > 1, whole_logprobs=echo)
                for p in prompts for _ in range(n)]  # fmt: skip

    def _choice(self, index: int, response: GenerateResponse, state: _ChoiceState) -> CompletionChoice:
        logprobs = None if response.logprobs is None else openai_logprobs.completion(response, len(state.prefix))
        return CompletionChoice(index, state.prefix + response.generated_text, logprobs, response.finish_reason)

    def _delta(self, index: int, text: str | None, state: _ChoiceState, logprobs: list[TokenLogprob] | None,
               end: GenerateResponse | None) -> CompletionChoice:  # fmt: skip
        if state.whole_logprobs and end is not None and end.logprobs is not None:
            out = openai_logprobs.completion(end, len(state.prefix))
        else:
            out = None if logprobs is None else openai_logprobs.completion_of([], logprobs, state.text_out)
        return CompletionChoice(index, text or "", out, end.finish_reason if end else None)


class ChatCompletionsResource(_OpenAIRoute):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"
    request_type = ChatCompletionRequest
    answer_type = ChatCompletion
    chunk_type = ChatCompletionChunk

    def __init__(
        self, client: AsyncClient, handlers: dict[str, Model], max_body_bytes: int, limits: Limits | None = None
    ) -> None:
        super().__init__(client, handlers, max_body_bytes, limits)
        # each model's tool-call parser for tool_choice auto, once (``auto`` reads its chat template's file)
        self.tool_parsers = {name: openai_params.tool_parser(model) for name, model in self.models.items()}

    def _requests(self, model: Model, body: ChatCompletionRequest) -> list[GenerateRequest]:
        return [openai_params.chat_request(body, openai_params.max_running(model))]

    def _refused(self, body: ChatCompletionRequest, exc: BadRequest) -> BadRequest:
        forced = body.tool_choice not in (None, "none", "auto")
        if forced and exc.field == "response_format":  # the grammar came from the tools' schemas
            return BadRequest(exc.message, field="tools")
        return exc

    def _states(self, model: Model, body: ChatCompletionRequest, prompts: list[GenerateRequest],
                n: int) -> list[_ChoiceState]:  # fmt: skip
        tools = openai_params.tooling(body)
        if tools is None:
            return super()._states(model, body, prompts, n)
        _, choice, parallel, _ = tools
        if choice == "none":
            return super()._states(model, body, prompts, n)
        if isinstance(choice, tool_calls.Function):
            mode, name = "named", choice.name
        else:
            mode, name = ("required" if choice == "required" else self.tool_parsers[body.model]), ""
        return [_ChoiceState(tools=tool_calls.ToolCallStream(mode, name=name, parallel=parallel), announce=n > 1)
                for _ in range(len(prompts) * n)]  # fmt: skip

    def _choice(self, index: int, response: GenerateResponse, state: _ChoiceState) -> ChatChoice:
        if state.tools is None:
            message = ChatMessageOut("assistant", response.generated_text)
            return ChatChoice(index, message, openai_logprobs.chat(response.logprobs), response.finish_reason)
        content, calls = tool_calls.whole(state.tools, response.generated_text)
        out = [ToolCall(c["id"], "function", FunctionCall(**c["function"])) for c in calls]
        message = ChatMessageOut("assistant", content, out)
        return ChatChoice(index, message, openai_logprobs.chat(response.logprobs), _finish_reason(response, state))

    def _deltas(self, index: int, text: str, tokens: list[TokenLogprob], end: GenerateResponse | None,
                state: _ChoiceState) -> list[Any]:  # fmt: skip
        if state.tools is None:
            return super()._deltas(index, text, tokens, end, state)
        pieces = (state.tools.feed(text) if text else []) + (state.tools.finish() if end is not None else [])
        deltas = [_piece_delta(p) for p in pieces]
        if not deltas and end is None and not state.started and state.announce:
            deltas = [ChatDelta()]
        out = [ChatChunkChoice(index, d, None, None) for d in deltas]
        if out and end is None:  # a call's text is held until it parses: its tokens' logprobs wait with it
            out[0].logprobs = openai_logprobs.chat(state.chunk_logprobs(tokens, None))
        else:
            state.hold(tokens)
        if end is not None:
            logprobs = openai_logprobs.chat(state.chunk_logprobs([], end))
            out.append(ChatChunkChoice(index, ChatDelta(), logprobs, _finish_reason(end, state)))
        if out and not state.started:
            out[0].delta.role = "assistant"
        state.started = state.started or bool(out)
        return out

    def _delta(self, index: int, text: str | None, state: _ChoiceState, logprobs: list[TokenLogprob] | None,
               end: GenerateResponse | None) -> ChatChunkChoice:  # fmt: skip
        delta = ChatDelta(role=None if state.started else "assistant", content=text)
        return ChatChunkChoice(index, delta, openai_logprobs.chat(logprobs), end.finish_reason if end else None)


def _finish_reason(response: GenerateResponse, state: _ChoiceState) -> str:
    """OpenAI's: "tool_calls" when the model chose to call (auto, required); a named tool_choice "stop"."""
    tools = state.tools
    if tools is not None and tools.calls and tools.mode != "named" and response.finish_reason == "stop":
        return "tool_calls"
    return response.finish_reason


def _piece_delta(piece: tool_calls.Piece) -> ChatDelta:
    if piece.content is not None:
        return ChatDelta(content=piece.content)
    if piece.id is not None:
        call = ToolCallDelta(piece.index, piece.id, "function", FunctionCallDelta(piece.name, piece.arguments))
    else:
        call = ToolCallDelta(piece.index, function=FunctionCallDelta(arguments=piece.arguments))
    return ChatDelta(tool_calls=[call])


class MiiResource(_GenerateRoute):
    """DeepSpeed-MII's RESTful gateway: ``POST /mii/{deployment}`` with ``{"prompts": str | [str], ...}``,
    answered with a list of ``{"generated_text", "generated_length", "prompt_length", "finish_reason"}``.
    MII's generation defaults apply: ``max_length`` (prompt + generated, 1024) unless ``max_new_tokens``,
    and sampling (``do_sample`` true, ``top_p`` 0.9) unless ``do_sample`` is false."""

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, deployment: str) -> None:
        async def work(named: list[str]) -> None:
            self._model(deployment)
            named.append(deployment)
            raw = await read_json(req, self.max_body_bytes)
            body = decode_body(raw, MiiRequest)
            # after the decode: a body without `prompts` is told so first; null is the default, known or not (MII
            # clients send every field)
            unknown = next((k for k, v in raw.items() if v is not None and k not in MiiRequest.__struct_fields__), None)
            if unknown is not None:
                raise BadRequest(f"Object contains unknown field `{unknown}`", field=unknown)
            prompts = body.prompts
            self.limits.check_inputs(deployment, len(prompts) if isinstance(prompts, list) else 1, "prompts", "prompts")
            self.limits.check_stop(body.stop)
            items = _mii_requests(body)
            priority, tenant = priority_and_tenant(req, body.priority)
            responses = await gather_or_cancel([self._run(deployment, item, priority, tenant) for item in items])
            resp.data = _json.encode(responses)
            resp.content_type = falcon.MEDIA_JSON

        await self._answer(resp, set_error, work)


# MiiRequest's fields that are GenerateRequest's too, passed as they are when given
_MII_SAMPLING = tuple(f for f in MiiRequest.__struct_fields__ if f in GenerateRequest.__struct_fields__)


def _mii_requests(body: MiiRequest) -> list[GenerateRequest]:
    """One ``GenerateRequest`` per prompt, with MII's defaults: sampling (temperature 1, top_p 0.9) unless
    ``do_sample`` is false (greedy), ``max_length`` 1024 unless ``max_new_tokens``; null is the default."""
    prompts = [body.prompts] if isinstance(body.prompts, str) else body.prompts
    if not prompts:
        raise BadRequest("`prompts` must be a string or a list of strings", field="prompts")
    sampling: dict[str, Any] = {f: v for f in _MII_SAMPLING if (v := getattr(body, f)) is not None}
    if body.do_sample is not False:
        sampling.setdefault("temperature", 1.0)
        sampling.setdefault("top_p", 0.9)
    else:
        sampling["temperature"] = 0.0
    if body.max_new_tokens is None:
        sampling.setdefault("max_length", 1024)
    if isinstance(body.stop, str):
        sampling["stop"] = [body.stop]
    return [GenerateRequest(prompt=p, **sampling) for p in prompts]

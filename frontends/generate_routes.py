"""Generation over HTTP: OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions`` (with
``stream: true`` as Server-Sent Events) and DeepSpeed-MII's ``/mii/{deployment}``.

Each route translates its body into a ``GenerateRequest`` (``zserve.generation``), validated here, in the
frontend, so a bad field is a 400 before anything reaches the broker; the engine does the rest. Errors on
the OpenAI routes come in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import falcon
import falcon.asgi
import msgspec

from zserve.client import AsyncClient, AsyncGenerationStream
from zserve.errors import BadRequest, ZserveError
from zserve.frontends import metrics
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
    MiiRequest,
    OpenAIError,
    OpenAIErrorDetail,
    Usage,
    decode_body,
)
from zserve.frontends.resources import RequestError, decode_item, openai_error, read_json, request_error, set_error
from zserve.generation import GenerateResponse
from zserve.model import Model

_json = msgspec.json.Encoder()
# OpenAI fields that would change the output and that we do not implement: refused, never ignored.
_UNSUPPORTED = {"logprobs": None, "top_logprobs": None, "echo": False, "best_of": 1, "suffix": None,
                "logit_bias": None, "presence_penalty": 0, "frequency_penalty": 0, "tools": None,
                "response_format": None}  # fmt: skip


def _openai_sampling(body: dict[str, Any], default_max_tokens: int | None) -> dict[str, Any]:
    """The GenerateRequest fields (less prompt/messages) for an OpenAI body, with vLLM's extensions
    (``ignore_eos``, ``min_tokens``, ``top_k``, ``stop_token_ids``)."""
    for name, neutral in _UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value != neutral and not (name.endswith("logprobs") and not value):
            raise BadRequest(f"`{name}` is not supported by this server", field=name)
    if body.get("n") not in (None, 1):
        raise BadRequest("only n=1 is supported", field="n")
    sampling: dict[str, Any] = {}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", default_max_tokens))
    if max_tokens is not None:
        sampling["max_new_tokens"] = max_tokens
    temperature = body.get("temperature")
    sampling["temperature"] = 1.0 if temperature is None else temperature  # OpenAI's default is 1, not greedy
    for ours, theirs in (("top_p", "top_p"), ("seed", "seed"), ("ignore_eos", "ignore_eos"),
                         ("min_new_tokens", "min_tokens"), ("stop_token_ids", "stop_token_ids")):  # fmt: skip
        if body.get(theirs) is not None:
            sampling[ours] = body[theirs]
    top_k = body.get("top_k")
    if top_k is not None:
        sampling["top_k"] = 0 if top_k == -1 else top_k  # vLLM spells "off" as -1
    stop = body.get("stop")
    if stop is not None:
        sampling["stop"] = [stop] if isinstance(stop, str) else stop
    return sampling


def _chat_messages(messages: Any) -> list[dict[str, str]]:
    """OpenAI messages (content as a string, or a list of text parts) as plain {role, content} pairs."""
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
        out.append({"role": m["role"], "content": content})
    return out


class _GenerateRoute:
    """What every generation route shares: the generative models, body reading, metrics."""

    def __init__(self, client: AsyncClient, handlers: dict[str, Model], max_body_bytes: int) -> None:
        self.client = client
        self.models = {name: h for name, h in handlers.items() if h.generative}
        self.max_body_bytes = max_body_bytes
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
            error = request_error(exc)
            if error is None:
                raise
            code = error.status
            write_error(resp, code, error.type_name, error.message, error.field)
        finally:
            if named and named[0] in self.metrics:
                self.metrics[named[0]].answered(code, time.perf_counter() - started)

    async def _run(self, name: str, item: Any) -> GenerateResponse:
        answer = await self.client.infer(name, item, decoded=True)
        return msgspec.convert(answer.value, GenerateResponse)


class _OpenAIRoute(_GenerateRoute):
    object_name = ""  # "text_completion" | "chat.completion"
    chunk_object_name = ""  # what a streamed event's "object" says
    id_prefix = ""
    request_type: type = CompletionRequest  # checks the JSON types of the fields (and /openapi.json shows it)
    answer_type: type = Completion
    chunk_type: type = Completion  # a streamed event's data

    def _requests(self, model: Model, body: dict[str, Any]) -> list[Any]:
        raise NotImplementedError

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        async def work(named: list[str]) -> None:
            body = await read_json(req, self.max_body_bytes)
            decode_body(body, self.request_type)
            name = body.get("model")
            model = self._model(name)
            named.append(name)
            items = self._requests(model, body)
            meta = {"id": f"{self.id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": name}
            if body.get("stream"):
                if len(items) != 1:
                    raise BadRequest("streaming takes one prompt per request", field="prompt")
                usage = bool((body.get("stream_options") or {}).get("include_usage"))
                stream = self.client.generate_stream(items[0], model=name, decoded=True)
                try:  # an error before any text (a prompt the engine refuses) is an HTTP error, not an event
                    first: str | None = await anext(stream)
                except StopAsyncIteration:
                    first = None  # finished without text
                except BaseException:
                    await stream.aclose()
                    raise
                resp.sse = self._stream(stream, first, meta, usage)
                resp.set_header("Cache-Control", "no-cache")
                return
            responses = await asyncio.gather(*(self._run(name, item) for item in items))
            resp.data = _json.encode(self._completion(meta, responses))
            resp.content_type = falcon.MEDIA_JSON

        await self._answer(resp, openai_error, work)

    def _completion(self, meta: dict[str, Any], responses: list[GenerateResponse]) -> Any:
        prompt_tokens = sum(r.prompt_length for r in responses)
        completion_tokens = sum(r.generated_length for r in responses)
        choices = [self._choice(i, r) for i, r in enumerate(responses)]
        return self.answer_type(**meta, object=self.object_name, choices=choices,
                                usage=_usage(prompt_tokens, completion_tokens))  # fmt: skip

    def _choice(self, index: int, response: GenerateResponse) -> Any:
        raise NotImplementedError

    def _delta(self, text: str | None, first: bool, finish_reason: str | None) -> Any:
        raise NotImplementedError

    def _event(self, meta: dict[str, Any], choices: list[Any], usage: Usage | None = None) -> falcon.asgi.SSEvent:
        chunk = self.chunk_type(**meta, object=self.chunk_object_name, choices=choices, usage=usage)
        return falcon.asgi.SSEvent(data=_json.encode(chunk))

    async def _stream(
        self, stream: AsyncGenerationStream, first_text: str | None, meta: dict[str, Any], usage: bool
    ) -> AsyncIterator[Any]:
        try:
            if first_text is not None:
                yield self._event(meta, [self._delta(first_text, True, None)])
            first = first_text is None
            async for text in stream:
                yield self._event(meta, [self._delta(text, first, None)])
                first = False
            r = stream.response
            yield self._event(meta, [self._delta(None, first, r.finish_reason)])
            if usage:
                yield self._event(meta, [], _usage(r.prompt_length, r.generated_length))
        except ZserveError as exc:  # the status line is out already: the error travels as an event
            error = OpenAIError(OpenAIErrorDetail(exc.message, exc.type_name, exc.field or None, None))
            yield falcon.asgi.SSEvent(data=_json.encode(error))
        finally:
            await stream.aclose()  # the client went away mid-stream: cancel, free the KV blocks
        yield falcon.asgi.SSEvent(data=b"[DONE]")


def _usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


class CompletionsResource(_OpenAIRoute):
    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def _requests(self, model: Model, body: dict[str, Any]) -> list[Any]:
        prompt = body.get("prompt")
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise BadRequest("`prompt` must be a string or a list of strings", field="prompt")
        sampling = _openai_sampling(body, default_max_tokens=16)  # OpenAI's default for completions
        return [decode_item(model, {"prompt": p, **sampling}) for p in prompts]

    def _choice(self, index: int, response: GenerateResponse) -> CompletionChoice:
        return CompletionChoice(index, response.generated_text, None, response.finish_reason)

    def _delta(self, text: str | None, first: bool, finish_reason: str | None) -> CompletionChoice:
        return CompletionChoice(0, text or "", None, finish_reason)


class ChatCompletionsResource(_OpenAIRoute):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"
    request_type = ChatCompletionRequest
    answer_type = ChatCompletion
    chunk_type = ChatCompletionChunk

    def _requests(self, model: Model, body: dict[str, Any]) -> list[Any]:
        sampling = _openai_sampling(body, default_max_tokens=None)  # None: the model's default
        return [decode_item(model, {"messages": _chat_messages(body.get("messages")), **sampling})]

    def _choice(self, index: int, response: GenerateResponse) -> ChatChoice:
        return ChatChoice(index, ChatMessageOut("assistant", response.generated_text), None, response.finish_reason)

    def _delta(self, text: str | None, first: bool, finish_reason: str | None) -> ChatChunkChoice:
        delta = ChatDelta(role="assistant" if first else None, content=text)
        return ChatChunkChoice(0, delta, None, finish_reason)


class MiiResource(_GenerateRoute):
    """DeepSpeed-MII's RESTful gateway: ``POST /mii/{deployment}`` with ``{"prompts": str | [str], ...}``,
    answered with a list of ``{"generated_text", "generated_length", "prompt_length", "finish_reason"}``.
    MII's generation defaults apply: ``max_length`` (prompt + generated, 1024) unless ``max_new_tokens``,
    and sampling (``do_sample`` true, ``top_p`` 0.9) unless ``do_sample`` is false."""

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, deployment: str) -> None:
        async def work(named: list[str]) -> None:
            model = self._model(deployment)
            named.append(deployment)
            body = await read_json(req, self.max_body_bytes)
            decode_body(body, MiiRequest)
            items = self._requests(model, body)
            responses = await asyncio.gather(*(self._run(deployment, item) for item in items))
            resp.data = _json.encode(responses)
            resp.content_type = falcon.MEDIA_JSON

        await self._answer(resp, set_error, work)

    def _requests(self, model: Model, body: dict[str, Any]) -> list[Any]:
        body = {key: value for key, value in body.items() if value is not None}  # null: the default
        prompts = body.pop("prompts", None)
        prompts = [prompts] if isinstance(prompts, str) else prompts
        if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise BadRequest("`prompts` must be a string or a list of strings", field="prompts")
        body.pop("stream", None)
        body.pop("return_full_text", None)
        if body.pop("do_sample", True):
            body.setdefault("temperature", 1.0)
            body.setdefault("top_p", 0.9)
        else:
            body["temperature"] = 0.0
        if "max_new_tokens" not in body:
            body.setdefault("max_length", 1024)
        if isinstance(body.get("stop"), str):
            body["stop"] = [body["stop"]]
        return [decode_item(model, {"prompt": p, **body}) for p in prompts]

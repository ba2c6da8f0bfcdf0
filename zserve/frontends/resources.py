"""The REST resources. Every error body is ``{"error": {"type", "message", "field"?}}``, except on the
OpenAI routes, which answer in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import falcon
import falcon.asgi
import msgspec

from zserve import payload
from zserve.client import Answer, AsyncClient
from zserve.errors import BadRequest, RateLimited, ZserveError
from zserve.frontends import metrics
from zserve.frontends.api_types import Error, ErrorDetail, OpenAIError, OpenAIErrorDetail
from zserve.frontends.limits import Limits
from zserve.generation import GenerateRequest, parse_generate_request
from zserve.model import Model
from zserve.protocol import HealthReport

log = logging.getLogger("zserve.frontend")

_json = msgspec.json.Encoder(enc_hook=payload.to_jsonable)
READY_CACHE_S = 0.5


def error_body(type_name: str, message: str, field: str = "") -> bytes:
    return _json.encode(Error(ErrorDetail(type_name, message, field or None)))


def set_error(resp: falcon.asgi.Response, http_status: int, type_name: str, message: str, field: str = "") -> None:
    resp.status = http_status
    resp.content_type = falcon.MEDIA_JSON
    resp.data = error_body(type_name, message, field)
    if http_status == 503:
        resp.set_header("Retry-After", "1")


def openai_error(resp: falcon.asgi.Response, http_status: int, code: str, message: str, param: str = "") -> None:
    """Like ``set_error``, in OpenAI's shape (``param`` is our ``field``, ``code`` our error type)."""
    if http_status < 500:
        kind = "authentication_error" if http_status == 401 else "invalid_request_error"
    else:
        kind = "overloaded_error" if http_status == 503 else "server_error"
    resp.status = http_status
    resp.content_type = falcon.MEDIA_JSON
    resp.data = _json.encode(OpenAIError(OpenAIErrorDetail(message, kind, param or None, code or None)))
    if http_status == 503:
        resp.set_header("Retry-After", "1")


# The routes that answer errors in OpenAI's shape (what OpenAI clients parse).
OPENAI_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/rerank", "/v2/rerank", "/v1/score",
                "/tokenize", "/detokenize")  # fmt: skip


def error_writer(path: str) -> Callable[..., None]:
    """``openai_error`` for the OpenAI routes, ``set_error`` for every other."""
    return openai_error if path in OPENAI_PATHS else set_error


class RequestError(Exception):
    """An HTTP-level rejection (size, syntax, unknown model) before a request reaches the broker."""

    def __init__(self, status: int, type_name: str, message: str, field: str = "", retry_after_s: int = 0) -> None:
        super().__init__(message)
        self.status = status
        self.type_name = type_name
        self.message = message
        self.field = field
        self.retry_after_s = retry_after_s  # a 429's Retry-After (whole seconds)


PRIORITY_HEADER = "X-Zserve-Priority"


def priority_and_tenant(req: falcon.asgi.Request, priority: int | None = None) -> tuple[int, str]:
    """A request's priority (``priority`` from its body, else the native routes' ``X-Zserve-Priority`` header,
    else its API key's default) and its key's tenant ("" without keys). Raises RequestError: 400 for a header
    that is not an integer, 403 for a priority more urgent than the key's ``max_priority``."""
    caller = getattr(req.context, "caller", None)
    field = "priority"
    if priority is None:
        header = req.get_header(PRIORITY_HEADER)
        if header is not None:
            field = PRIORITY_HEADER
            try:
                priority = int(header)
            except ValueError:
                raise RequestError(400, "bad_request", f"{PRIORITY_HEADER} must be an integer", field) from None
            if not -1_000_000 <= priority <= 1_000_000:
                raise RequestError(400, "bad_request", f"{PRIORITY_HEADER} must be within +-1000000", field)
    # A key's requests may not be more urgent than its line allows (an open API trusts every caller).
    if priority is not None and caller is not None and (refusal := caller.priority_refusal(priority)) is not None:
        raise RequestError(403, "permission_denied", refusal, field)
    if priority is None:
        priority = caller.priority if caller is not None else 0
    return priority, caller.tenant if caller is not None else ""


# Deeper than any API body needs, far below what the decoder and the msgpack codec can recurse through (a
# 5,000-deep body would otherwise be a RecursionError, a 500).
MAX_JSON_DEPTH = 128


def _too_deep(value: Any, limit: int) -> bool:
    """Whether ``value`` (decoded JSON) nests containers deeper than ``limit``; iterative, stops early."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if type(node) is dict else node
        stack.extend((child, depth + 1) for child in children if type(child) in (list, dict))
    return False


def decode_json(raw: bytes) -> Any:
    """``raw`` as JSON, for every route: not JSON, or nested past MAX_JSON_DEPTH, is a 400 naming ``body``."""
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise RequestError(400, "bad_request", f"body is not valid JSON: {exc}", "body") from None
    except RecursionError:
        value = None  # deeper than the decoder itself goes: over the limit by far
    else:
        # A body with fewer brackets than the limit cannot nest past it: most bodies skip the walk.
        if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH or type(value) not in (list, dict):
            return value
        if not _too_deep(value, MAX_JSON_DEPTH):
            return value
    raise RequestError(400, "bad_request", f"body nests deeper than {MAX_JSON_DEPTH} levels", "body")


async def read_raw(req: falcon.asgi.Request, max_body_bytes: int) -> bytes:
    """The request's body, at most ``max_body_bytes`` (413 past it)."""
    if req.content_length is not None and req.content_length > max_body_bytes:
        raise RequestError(413, "payload_too_large", f"body of {req.content_length} bytes is over {max_body_bytes}")
    raw = await req.stream.read(max_body_bytes + 1)
    if len(raw) > max_body_bytes:
        raise RequestError(413, "payload_too_large", f"body is over {max_body_bytes} bytes")
    return raw


async def read_json(req: falcon.asgi.Request, max_body_bytes: int) -> Any:
    """The request's JSON body, at most ``max_body_bytes`` (413 past it, 400 if it is not JSON)."""
    return decode_json(await read_raw(req, max_body_bytes))


# Bodies the native route hands to decode_request as bytes, not JSON (an image file, say).
RAW_CONTENT_TYPES = ("application/octet-stream", "image/")


def decode_item(handler: Model, body: Any) -> Any:
    """``handler.decode_request(body)``: whatever it raises is the client's bad input (400), never a 500."""
    try:
        return handler.decode_request(body)
    except BadRequest:
        raise
    except RecursionError:
        raise BadRequest("the request nests too deeply for the model", field="body") from None
    except Exception as exc:
        raise BadRequest(f"decode_request rejected the body: {type(exc).__name__}: {exc}") from None


def request_error(exc: BaseException) -> RequestError | None:
    """The one mapping from what reading, decoding and submitting a request can raise to its HTTP error
    (None: not the client's doing, a real server error)."""
    if isinstance(exc, RequestError):
        return exc
    if isinstance(exc, payload.PayloadError):  # e.g. an integer past 64 bits: JSON has them, msgpack does not
        return RequestError(400, "bad_request", f"the request cannot travel to the model: {exc}", "body")
    if isinstance(exc, RateLimited):
        return RequestError(429, exc.type_name, exc.message, exc.field, max(1, math.ceil(exc.retry_after_s)))
    if isinstance(exc, ZserveError):
        return RequestError(exc.http_status, exc.type_name, exc.message, exc.field)
    return None


def answer_error(resp: falcon.asgi.Response, exc: Exception, write: Callable[..., None] = set_error) -> int:
    """Write ``exc`` on ``resp`` as its HTTP error with ``write`` (``set_error``, or ``openai_error`` for the
    OpenAI routes) and return the status; an exception that is not the client's doing is raised again."""
    error = request_error(exc)
    if error is None:
        raise exc
    write(resp, error.status, error.type_name, error.message, error.field)
    if error.retry_after_s:
        resp.set_header("Retry-After", str(error.retry_after_s))
    return error.status


class Health:
    """Broker health, fetched at most every READY_CACHE_S per worker."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self._report: HealthReport | None = None
        self._at = 0.0

    async def report(self, max_age_s: float = READY_CACHE_S) -> HealthReport | None:
        now = time.monotonic()
        if self._report is None or now - self._at > max_age_s:
            try:
                self._report = await self.client.health(timeout_s=1.0)
            except ZserveError:
                self._report = None
            self._at = now
        return self._report


class PredictRoute:
    """The native predict route without HTTP: a body to the model's item, an Answer to the response body.
    The falcon resource and the fast HTTP path (``fast_http.py``) both run it, so they answer alike."""

    def __init__(
        self, client: AsyncClient, handlers: dict[str, Model], max_body_bytes: int, limits: Limits | None = None
    ) -> None:
        self.client = client
        self.handlers = handlers
        self.max_body_bytes = max_body_bytes
        self.limits = limits or Limits()
        self.metrics = {name: metrics.ModelMetrics(name) for name in handlers}

    def item(self, handler: Model, raw: bytes, content_type: str) -> Any:
        """``decode_request`` of the body (read within ``max_body_bytes`` by the caller): bytes for a raw
        content type (RAW_CONTENT_TYPES), else its JSON; a generation request within ``[limits]``. Raises
        RequestError or BadRequest (400)."""
        body = raw if content_type.lower().startswith(RAW_CONTENT_TYPES) else decode_json(raw)
        item = decode_item(handler, body)
        request = item
        if getattr(handler, "generative", False) and not isinstance(item, GenerateRequest):
            # a generative model of the contract before 2026-12-07 returns a GenerateRequest-shaped dict: its
            # limits hold all the same (the dict itself travels, as it did)
            request = parse_generate_request(item)
        if isinstance(request, GenerateRequest):
            limits = self.limits
            limits.check_stop(request.stop)
            limits.check_logit_bias(request.logit_bias)
            limits.check_tools(request.tools)
            if request.json_schema is not None:
                limits.check_schema(request.json_schema, "json_schema")
        return item

    @staticmethod
    def response_body(handler: Model, answer: Answer) -> bytes:
        """``encode_response`` of the model's output, as JSON (raises what ``encode_response`` raises)."""
        return _json.encode(handler.encode_response(answer.value))


class PredictResource:
    def __init__(self, route: PredictRoute) -> None:
        self.route = route

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, name: str) -> None:
        started = time.perf_counter()
        handler = self.route.handlers.get(name)
        if handler is None:
            return set_error(resp, 404, "unknown_model", f"no model named {name!r}; see GET /v1/models")
        code, batch_size = await self._predict(req, resp, name, handler)
        self.route.metrics[name].answered(code, time.perf_counter() - started, batch_size)

    async def _predict(
        self, req: falcon.asgi.Request, resp: falcon.asgi.Response, name: str, handler: Model
    ) -> tuple[int, int]:
        """(HTTP status, batch size)."""
        try:
            raw = await read_raw(req, self.route.max_body_bytes)
            item = self.route.item(handler, raw, req.content_type or "")
            priority, tenant = priority_and_tenant(req)
            answer = await self.route.client.infer(name, item, decoded=True, priority=priority, tenant=tenant)
        except Exception as exc:
            return answer_error(resp, exc), 0
        try:
            resp.data = self.route.response_body(handler, answer)
        except Exception as exc:
            log.exception("encode_response failed for model %s", name)
            set_error(resp, 500, "model_error", f"encode_response raised {type(exc).__name__}: {exc}")
            return 500, 0
        resp.content_type = falcon.MEDIA_JSON
        resp.set_header("X-Zserve-Batch-Size", str(answer.batch_size))
        resp.set_header("X-Zserve-Queue-Ms", f"{answer.queue_ms:.3f}")
        return 200, answer.batch_size


class ModelsResource:
    def __init__(self, handlers: dict[str, Model]) -> None:
        self.handlers = handlers

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        data = [
            {
                "id": name,
                "object": "model",
                "owned_by": "zserve",
                "handler": type(h).__module__ + ":" + type(h).__name__,
            }
            for name, h in self.handlers.items()
        ]
        resp.data = _json.encode({"object": "list", "data": data})
        resp.content_type = falcon.MEDIA_JSON


class LiveResource:
    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.media = {"status": "ok"}


class ReadyResource:
    """200 when the broker answers and every model has at least one ready engine; 503 otherwise."""

    def __init__(self, health: Health, models: list[str], staged: list[str]) -> None:
        self.health = health
        self.models = models
        self.staged = staged

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        report = await self.health.report()
        if report is None:
            return set_error(resp, 503, "not_ready", "the broker does not answer")
        if report.draining:
            return set_error(resp, 503, "not_ready", "the server is shutting down")
        ready = {m.name: m.ready_workers for m in report.models}
        stages = {m.name: m.preprocess_workers for m in report.models}
        waiting = [name for name in self.models if ready.get(name, 0) < 1]
        waiting += [f"{name} (preprocess)" for name in self.staged if stages.get(name, 0) < 1]
        if waiting:
            return set_error(resp, 503, "not_ready", f"no ready worker for: {', '.join(waiting)}")
        resp.media = {"status": "ready", "engines": ready, "preprocess_workers": {n: stages[n] for n in self.staged}}


class MetricsResource:
    def __init__(self, health: Health) -> None:
        self.health = health

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        # Fresh at every scrape (scrapes are rare; load balancers poll /readyz, which uses the cache).
        resp.data = metrics.render(await self.health.report(max_age_s=0.0))
        resp.content_type = metrics.CONTENT_TYPE


def error_serializer(req: Any, resp: Any, exc: falcon.HTTPError) -> None:
    """falcon's own errors (unknown route, wrong method) in the route's error shape."""
    title = (exc.title or "error").split(" ", 1)[-1] if (exc.title or "")[:3].isdigit() else (exc.title or "error")
    error_writer(req.path)(resp, exc.status_code, title.lower().replace(" ", "_"), exc.description or title)

"""The fast HTTP/1.1 path of a frontend worker: ``POST /v1/models/{name}/predict`` answered without ASGI,
without falcon, and without a task or a future per request.

Why: under gunicorn's ASGI protocol and falcon a predict request cost ~120 us of worker CPU (a task and
several futures per request, the scope dict, the response assembled from ASGI messages), four times what
the whole ZeroMQ path behind it costs (issue 9's profile). Here a request is parsed by gunicorn's own C
parser (gunicorn_h1c) inside ``data_received``, turned into the model's item by the same ``PredictRoute``
as the falcon resource, and handed to the worker's AsyncClient with the request itself as its waiter: the
requests of one event-loop turn leave in one Submits message, and each reply is written from the client's
reply dispatch, in the order the requests arrived on their connection.

Every other request (another route or method, a model name this worker does not know) goes to gunicorn's
ASGI protocol and the falcon app, unchanged: the connection is handed over with that request's bytes once
the fast path has answered everything it holds, and stays there. So errors, auth, metrics and answers are
the same whichever path serves a request; only the ``Server`` header tells them apart (``zserve`` here).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from email.utils import formatdate
from http import HTTPStatus
from typing import Any

import gunicorn_h1c
from gunicorn.asgi.protocol import ASGIProtocol

from zserve.client.pending import answer_of
from zserve.frontends.resources import PredictRoute, error_body, request_error
from zserve.model import Model
from zserve.protocol import Reply

log = logging.getLogger("zserve.frontend")

_PREFIX = b"/v1/models/"
_SUFFIX = b"/predict"
# Requests one connection may have waiting for answers (HTTP pipelining) before it is read no further.
MAX_PIPELINED = 64
SWEEP_INTERVAL_S = 0.25
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


class _Clock:
    """The Date header's value, refreshed by the sweep (HTTP/1.1 servers with a clock send Date)."""

    line = b""

    @classmethod
    def refresh(cls) -> None:
        cls.line = b"Date: " + formatdate(usegmt=True).encode() + b"\r\n"


_Clock.refresh()


CLOSE = b"Connection: close\r\n"
KEEP_ALIVE = b"Connection: keep-alive\r\n"  # HTTP/1.0 clients that asked for it (1.1 keeps alive by default)


def response(status: int, body: bytes, extra: bytes = b"", connection: bytes = b"") -> bytes:
    """A whole JSON response: status line, headers (``extra``: more header lines, each ending CRLF), body."""
    head = b"HTTP/1.1 %d %s\r\nServer: zserve\r\n%sContent-Type: application/json\r\nContent-Length: %d\r\n"
    head %= (status, _REASONS.get(status, b"Unknown"), _Clock.line, len(body))
    return head + extra + connection + b"\r\n" + body


def error_response(status: int, type_name: str, message: str, field: str = "", connection: bytes = b"") -> bytes:
    """An error in the native routes' shape (``resources.set_error``'s), 503s with Retry-After."""
    extra = b"Retry-After: 1\r\n" if status == 503 else b""
    if status == 401:
        extra += b"WWW-Authenticate: Bearer\r\n"
    return response(status, error_body(type_name, message, field), extra, connection)


class _Request:
    """One predict request of a connection, and its waiter in the client's pending table."""

    __slots__ = ("auth_header", "chunks", "conn", "content_type", "handler", "http10", "keep_alive", "name", "out",
                 "req_id", "size", "started")  # fmt: skip

    def __init__(self, conn: FastHttpProtocol, name: str, handler: Model | None, keep_alive: bool) -> None:
        self.conn = conn
        self.name = name
        self.handler = handler
        self.keep_alive = keep_alive
        self.http10 = False
        self.started = conn.loop.time()
        self.chunks: list[bytes] = []
        self.size = 0
        self.content_type = ""
        self.auth_header: str | None = None
        self.req_id: int | None = None  # while the broker has it
        self.out: bytes | None = None  # the whole response, once known

    # ---- Waiter (called by the client's pending table) ----

    def chunk(self, text: str) -> None:  # predict requests do not stream
        pass

    def reply(self, reply: Reply, frames: list[Any]) -> None:
        self.req_id = None
        try:
            answer = answer_of(reply, frames)
        except Exception as exc:
            return self.fail(exc)
        connection = self.connection()
        try:
            body = PredictRoute.response_body(self.handler, answer)
        except Exception as exc:
            log.exception("encode_response failed for model %s", self.name)
            message = f"encode_response raised {type(exc).__name__}: {exc}"
            return self.answer(500, error_response(500, "model_error", message, connection=connection))
        extra = b"X-Zserve-Batch-Size: %d\r\nX-Zserve-Queue-Ms: %.3f\r\n" % (answer.batch_size, answer.queue_ms)
        self.answer(200, response(200, body, extra, connection), answer.batch_size)

    def fail(self, error: BaseException) -> None:
        self.req_id = None
        connection = self.connection()
        known = request_error(error)
        if known is None:  # not the client's doing: a bug, answered and logged, never a dropped connection
            log.error("request to model %s failed", self.name, exc_info=error)
            self.answer(500, error_response(500, "internal", f"{type(error).__name__}: {error}", connection=connection))
        else:
            out = error_response(known.status, known.type_name, known.message, known.field, connection)
            self.answer(known.status, out)

    def connection(self) -> bytes:
        """The answer's Connection header: close when the client asked, or when the worker is stopping and
        nothing else waits on the connection; keep-alive for an HTTP/1.0 client that asked for it."""
        conn = self.conn
        if not conn.worker.alive and len(conn.queue) == 1:
            self.keep_alive = False
        if not self.keep_alive:
            return CLOSE
        return KEEP_ALIVE if self.http10 else b""

    def answer(self, status: int, out: bytes, batch_size: int = 0) -> None:
        self.out = out
        self.conn.route.metrics[self.name].answered(status, self.conn.loop.time() - self.started, batch_size)
        self.conn.write_answered()


class FastHttpProtocol(asyncio.Protocol):
    """One HTTP/1.1 connection of a worker (see the module's docstring)."""

    def __init__(self, worker: Any, connections: FastConnections) -> None:
        self.worker = worker
        self.loop = worker.loop
        self.route: PredictRoute = worker.frontend.predict
        self.auth = worker.frontend.auth
        self.connections = connections
        cfg = worker.cfg
        self.parser = gunicorn_h1c.H1CProtocol(
            on_headers_complete=self._on_headers,
            on_body=self._on_body,
            on_message_complete=self._on_complete,
            limit_request_line=cfg.limit_request_line or (1 << 20),  # 0 = unlimited in gunicorn's terms
            limit_request_fields=cfg.limit_request_fields,
            limit_request_field_size=cfg.limit_request_field_size,
        )
        self.transport: asyncio.Transport | None = None
        self._raw: bytearray | None = bytearray()  # the message's bytes until it is known to be ours
        self._current: _Request | None = None  # the message being parsed, when it is ours
        self._complete = False
        self._handover = False  # the message being parsed is the ASGI app's
        self.queue: deque[_Request] = deque()  # arrival order = answer order
        self._closed = False
        self._closing = False  # closed by us: the transport flushes, then connection_lost
        self._reading = True
        self._writing = True
        self.seen = False  # bytes arrived since the last sweep
        self.idle_s = 0.0

    # ---- asyncio ----

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.worker.nr_conns += 1
        self.connections.open.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._closed:
            return
        self._closed = True
        self.connections.open.discard(self)
        self.worker.nr_conns -= 1
        for request in self.queue:  # the client hung up: what it still waits for leaves the broker's queue
            if request.req_id is not None:
                self.route.client.cancel(request.req_id)
        self.queue.clear()

    def pause_writing(self) -> None:
        self._writing = False
        self._pause_reading()

    def resume_writing(self) -> None:
        self._writing = True
        self._resume_reading()

    def data_received(self, data: bytes) -> None:
        self.seen = True
        if self._handover:  # bytes behind a request for the ASGI app, before the handover
            self._raw += data
            return
        while True:
            if self._raw is not None:
                self._raw += data
            try:
                self.parser.feed(data)
            except Exception as exc:  # gunicorn_h1c's parse errors and limits (ValueErrors), or a bug of ours
                return self._bad_request(exc)
            if self._handover:
                if not self.queue:
                    self._hand_over()
                else:
                    self._pause_reading()  # the answers before it go first
                return
            if not self._complete:
                return
            request = self._current
            self._complete = False
            self._current = None
            truncated = self.parser.remaining_truncated
            rest = self.parser.remaining()
            self.parser.reset()
            self._raw = bytearray()
            if truncated:  # a pipelined tail past the parser's cap cannot be replayed safely
                request.keep_alive = False
            self._submit(request)
            if not rest or self._closed or not request.keep_alive:
                return
            data = rest

    # ---- parser callbacks ----

    def _on_headers(self) -> bool:
        parser = self.parser
        path = parser.path
        handler = None
        if parser.method == b"POST" and not parser.should_upgrade:
            query = path.find(b"?")
            if query >= 0:
                path = path[:query]
            if path.startswith(_PREFIX) and path.endswith(_SUFFIX):
                name = path[len(_PREFIX) : -len(_SUFFIX)].decode("latin-1")
                handler = self.route.handlers.get(name)
        if handler is None:
            self._handover = True
            return False
        self._raw = None
        request = self._current = _Request(self, name, handler, parser.should_keep_alive)
        request.http10 = parser.http_version == (1, 0)
        request.content_type = (parser.get_header(b"content-type") or b"").decode("latin-1")
        if self.auth is not None:
            header = parser.get_header(b"authorization")
            request.auth_header = None if header is None else header.decode("latin-1")
        length = parser.content_length  # None: chunked
        if length is not None and length > self.route.max_body_bytes:
            self._too_large(request)
        elif (parser.get_header(b"expect") or b"").lower() == b"100-continue" and not self.queue:
            self.transport.write(_CONTINUE)
        return False

    def _on_body(self, chunk: bytes) -> None:
        request = self._current
        if request is not None:
            request.size += len(chunk)
            request.chunks.append(bytes(chunk))
            if request.size > self.route.max_body_bytes:  # chunked: no Content-Length said so up front
                self._too_large(request)

    def _on_complete(self) -> None:
        if self._current is not None:
            self._complete = True

    # ---- requests ----

    def _too_large(self, request: _Request) -> None:
        """Answer 413 at once and close: the rest of the body is never read (nor parsed)."""
        self._current = None
        self.queue.append(request)
        self._pause_reading()
        request.keep_alive = False
        message = f"body is over {self.route.max_body_bytes} bytes"
        request.answer(413, error_response(413, "payload_too_large", message, connection=CLOSE))

    def _submit(self, request: _Request) -> None:
        self.queue.append(request)
        route = self.route
        if self.auth is not None:
            refusal = self.auth.refusal(f"/v1/models/{request.name}/predict", request.auth_header)
            if refusal is not None:
                out = error_response(401, "invalid_api_key", refusal, connection=request.connection())
                return request.answer(401, out)
        try:
            raw = request.chunks[0] if len(request.chunks) == 1 else b"".join(request.chunks)
            request.chunks = []
            item = route.item(request.handler, raw, request.content_type)
            request.req_id = route.client.start(request.name, item, request, decoded=True)
        except Exception as exc:
            return request.fail(exc)
        if len(self.queue) >= MAX_PIPELINED:
            self._pause_reading()

    def write_answered(self) -> None:
        """Write every answered request at the head of the queue (answers leave in arrival order)."""
        queue = self.queue
        if self._closed or self._closing or not queue or queue[0].out is None:
            return
        transport = self.transport
        while queue and queue[0].out is not None:
            request = queue.popleft()
            transport.write(request.out)
            self.worker.nr += 1
            if not request.keep_alive:
                return self._close()
        if not queue:
            if self._handover:
                self._hand_over()
            else:
                self._resume_reading()
        elif len(queue) < MAX_PIPELINED // 2:
            self._resume_reading()

    def _bad_request(self, exc: Exception) -> None:
        """Answer a request that cannot be parsed (after those before it) and close the connection."""
        message = f"malformed HTTP request: {exc}"
        if isinstance(exc, gunicorn_h1c.LimitRequestLine):
            status, type_name = 414, "uri_too_long"
        elif isinstance(exc, gunicorn_h1c.LimitRequestHeaders):
            status, type_name = 431, "request_header_fields_too_large"
        elif isinstance(exc, ValueError):
            status, type_name = 400, "bad_request"
        else:
            log.error("fast HTTP path failed on a request", exc_info=exc)
            status, type_name, message = 500, "internal", f"{type(exc).__name__}: {exc}"
        request = _Request(self, "", None, keep_alive=False)
        request.out = error_response(status, type_name, message, connection=CLOSE)
        self.queue.append(request)
        self._pause_reading()
        self.write_answered()

    # ---- connection ----

    def _hand_over(self) -> None:
        """Give the connection, with the unanswered request's bytes, to gunicorn's ASGI protocol."""
        raw, self._raw = bytes(self._raw or b""), None
        self._closed = True
        self.connections.open.discard(self)
        self.worker.nr_conns -= 1  # the ASGI protocol counts it again
        transport = self.transport
        if not self._reading:
            transport.resume_reading()
        protocol = ASGIProtocol(self.worker)
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if raw:
            protocol.data_received(raw)

    def _pause_reading(self) -> None:
        if self._reading and not self._closed:
            self._reading = False
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if not self._reading and self._writing and not self._closed and not self._handover:
            self._reading = True
            self.transport.resume_reading()

    def _close(self) -> None:
        self._closing = True
        self.transport.close()  # connection_lost follows, once what was written is flushed

    def sweep(self, interval_s: float, keepalive_s: float) -> None:
        """Close this connection if it has been idle past ``keepalive_s``. Not sooner when the worker stops:
        a client may be sending on it right now (closing would fail that request); a request that arrives
        then is answered with ``Connection: close``, as gunicorn's own protocol does."""
        if self.queue or self._closed or self._closing:
            return
        if self.seen:
            self.seen = False
            self.idle_s = 0.0
        else:
            self.idle_s += interval_s
        if self.idle_s >= keepalive_s:
            self._close()


class FastConnections:
    """A worker's fast-path connections, swept every SWEEP_INTERVAL_S: idle keep-alive connections close
    after gunicorn's ``--keep-alive`` seconds (a stopping worker's graceful shutdown waits for them), and the
    Date header is refreshed."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.open: set[FastHttpProtocol] = set()

    async def sweep(self) -> None:
        keepalive_s = float(self.worker.cfg.keepalive)
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            _Clock.refresh()
            for conn in list(self.open):
                conn.sweep(SWEEP_INTERVAL_S, keepalive_s)

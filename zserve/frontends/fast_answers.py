"""What the fast HTTP path (``fast_http.py``) answers: whole HTTP/1.1 responses as bytes, and the request
object that waits for its answer in the AsyncClient's pending table."""

from __future__ import annotations

import logging
from email.utils import formatdate
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from zserve.client.pending import answer_of
from zserve.frontends.resources import PredictRoute, error_body, request_error
from zserve.model import Model
from zserve.protocol import Chunk, Reply

if TYPE_CHECKING:
    from zserve.frontends.fast_http import FastHttpProtocol

log = logging.getLogger("zserve.frontend")

CLOSE = b"Connection: close\r\n"
KEEP_ALIVE = b"Connection: keep-alive\r\n"  # HTTP/1.0 clients that asked for it (1.1 keeps alive by default)
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


class DateHeader:
    """The Date header line, refreshed by the connection sweep (HTTP/1.1 servers with a clock send Date)."""

    line = b""

    @classmethod
    def refresh(cls) -> None:
        cls.line = b"Date: " + formatdate(usegmt=True).encode() + b"\r\n"


DateHeader.refresh()


class KeepAliveHeader:
    """What an answer that keeps its connection open says about it: ``Keep-Alive: timeout=N``, the idle time the
    worker advertises (gunicorn_internals.advertised_keepalive_s, set when the worker starts), so that clients
    that read it (Node's undici, curl) stop reusing the connection before the server closes it."""

    http11 = b""
    http10 = KEEP_ALIVE  # HTTP/1.0 clients that asked for keep-alive must be told it is kept

    @classmethod
    def set(cls, timeout_s: int) -> None:
        cls.http11 = b"Keep-Alive: timeout=%d\r\n" % timeout_s
        cls.http10 = KEEP_ALIVE + cls.http11


def response(status: int, body: bytes, extra: bytes = b"", connection: bytes = b"") -> bytes:
    """A whole JSON response: status line, headers (``extra``: more header lines, each ending CRLF), body."""
    head = b"HTTP/1.1 %d %s\r\nServer: zserve\r\n%sContent-Type: application/json\r\nContent-Length: %d\r\n"
    head %= (status, _REASONS.get(status, b"Unknown"), DateHeader.line, len(body))
    return head + extra + connection + b"\r\n" + body


def error_response(
    status: int, type_name: str, message: str, field: str = "", connection: bytes = b"", retry_after_s: int = 0
) -> bytes:
    """An error in the native routes' shape (``resources.set_error``'s), 503s and 429s with Retry-After."""
    extra = b"Retry-After: %d\r\n" % (retry_after_s or 1) if status == 503 or retry_after_s else b""
    if status == 401:
        extra += b"WWW-Authenticate: Bearer\r\n"
    return response(status, error_body(type_name, message, field), extra, connection)


class PendingRequest:
    """One predict request of a connection, from its headers to its answer; the client's waiter for it."""

    __slots__ = ("auth_header", "chunks", "conn", "content_type", "handler", "http10", "keep_alive", "name", "out",
                 "req_id", "size", "started", "wants_continue")  # fmt: skip

    def __init__(self, conn: FastHttpProtocol, name: str, handler: Model | None, keep_alive: bool) -> None:
        self.conn = conn
        self.name = name
        self.handler = handler
        self.keep_alive = keep_alive
        self.http10 = False
        self.wants_continue = False  # Expect: 100-continue, sent once the answers before it are out
        self.started = conn.loop.time()
        self.chunks: list[bytes] = []
        self.size = 0
        self.content_type = ""
        self.auth_header: str | None = None
        self.req_id: int | None = None  # while the broker has it
        self.out: bytes | None = None  # the whole response, once known

    # ---- Waiter (called by the client's pending table; must not raise) ----

    def chunk(self, chunk: Chunk) -> None:  # predict requests do not stream
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
            out = error_response(known.status, known.type_name, known.message, known.field, connection,
                                 known.retry_after_s)  # fmt: skip
            self.answer(known.status, out)

    # ---- answering ----

    def connection(self) -> bytes:
        """The answer's Connection header: close when the client asked, or when the worker is stopping and
        nothing else waits on the connection; else how long it is kept (and keep-alive for an HTTP/1.0 client)."""
        conn = self.conn
        if not conn.worker.alive and len(conn.queue) == 1:  # gunicorn's field (gunicorn_internals.WORKER_FIELDS)
            self.keep_alive = False
        if not self.keep_alive:
            return CLOSE
        return KeepAliveHeader.http10 if self.http10 else KeepAliveHeader.http11

    def answer(self, status: int, out: bytes, batch_size: int = 0) -> None:
        """Counted in the route's metrics, then written when the answers before it are."""
        self.conn.route.metrics[self.name].answered(status, self.conn.loop.time() - self.started, batch_size)
        self.deliver(out)

    def deliver(self, out: bytes) -> None:
        """Written when the answers before it are (not counted: what falcon answers before a route, too)."""
        self.out = out
        try:
            self.conn.write_answered()
        except Exception:  # never into the client's reply dispatch: the other replies of its message go on
            log.exception("fast HTTP path: writing an answer failed; the connection is dropped")
            self.conn.abort()

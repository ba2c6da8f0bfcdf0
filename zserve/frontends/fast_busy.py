"""A connection that arrives when its worker already holds ``--worker-connections`` (``[frontends]
max_connections``): its first request is answered 503 ``overloaded`` with ``Retry-After`` and ``Connection: close``
(400 if it is not HTTP), and the connection ends. Never a silent close: a client that sent a request always reads an
answer it can act on.

gunicorn's asgi worker accepts connections without a limit; uvicorn's ``--limit-concurrency`` answers 503 past its
limit the same way. The answer is written once the request's head is parsed, not at accept: a client reads a response
only after it has sent its request, and the bytes it still sends (the body) are read and dropped a while before the
close (LINGER_S), since closing a socket with unread bytes resets it and the client may lose the answer.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import gunicorn_h1c

from zserve.frontends import gunicorn_internals
from zserve.frontends.fast_answers import CLOSE, error_response
from zserve.frontends.fast_http import LINGER_S

if TYPE_CHECKING:
    from zserve.frontends.fast_http import FastConnections

log = logging.getLogger("zserve.frontend")

RETRY_AFTER_S = 1


class BusyConnection(asyncio.Protocol):
    """One connection over the worker's limit: answered at its first request's head, then closed."""

    def __init__(self, worker: Any, connections: FastConnections) -> None:
        self.worker = worker
        self.connections = connections
        self.parser = gunicorn_h1c.H1CProtocol(on_headers_complete=self._on_headers, **connections.parser_limits)
        self.transport: asyncio.Transport | None = None
        self.answered = False
        self.received = False  # some bytes of a request came
        self.timer: asyncio.TimerHandle | None = None
        self.opened_s = worker.loop.time()
        # Counted as open, so that a stopping worker waits for the answer; not as one the limit is for. Counted
        # when accepted (as FastHttpProtocol is), uncounted once, in connection_lost.
        gunicorn_internals.connection_opened(worker)
        connections.busy.add(self)
        self.counted = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.timer = self.worker.loop.call_later(gunicorn_internals.keepalive_s(self.worker), self._expire)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.counted:
            self.counted = False
            self.connections.busy.discard(self)
            gunicorn_internals.connection_closed(self.worker)

    def _expire(self) -> None:
        """No whole request head within the idle time: 408 for a request begun; a client that sent nothing is
        closed like an idle one (there is no request to answer)."""
        if not self.received:
            self.transport.close()
        elif not self.answered:
            message = "the request was not sent whole within the keep-alive time"
            self._answer(error_response(408, "request_timeout", message, connection=CLOSE))

    def drain(self, now_s: float, min_idle_s: float) -> None:
        """The worker stops: a client that has sent nothing for ``min_idle_s`` since it connected is closed now
        (FastConnections.drain), not after the idle time; a request begun is still answered."""
        transport = self.transport
        if self.received or transport is None or transport.is_closing() or now_s - self.opened_s < min_idle_s:
            return
        if self.timer is not None:
            self.timer.cancel()
        transport.close()

    def data_received(self, data: bytes) -> None:
        self.received = True
        if self.answered:
            return  # the rest of a request that is answered already: dropped
        try:
            self.parser.feed(data)
        except Exception as exc:  # gunicorn_h1c's parse errors and limits: not HTTP, so not a request to refuse
            if not self.answered:
                message = f"malformed HTTP request: {exc}"
                self._answer(error_response(400, "bad_request", message, connection=CLOSE))

    def _on_headers(self) -> bool:
        limit = gunicorn_internals.max_connections(self.worker)
        message = (f"this frontend worker holds its {limit} connections ([frontends] max_connections): "
                   "retry on a new connection")  # fmt: skip
        self.connections.refused += 1
        self._answer(error_response(503, "overloaded", message, connection=CLOSE, retry_after_s=RETRY_AFTER_S))
        return False

    def _answer(self, out: bytes) -> None:
        self.answered = True
        transport = self.transport
        if self.timer is not None:
            self.timer.cancel()
        transport.write(out)
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()  # our side is done; what the client still sends is read and dropped, then we close
        self.timer = self.worker.loop.call_later(LINGER_S, transport.close)

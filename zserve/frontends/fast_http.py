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

Each connection's life (reading, holding pipelined bytes, handing over, its last answer, closing) is one
``ConnState`` of ``fast_state.py``, where the states and their allowed transitions are; what this takes of
gunicorn's internals is in ``gunicorn_internals.py``.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

import gunicorn_h1c

from zserve.frontends import gunicorn_internals
from zserve.frontends.auth import ANONYMOUS
from zserve.frontends.fast_answers import CLOSE, CONTINUE, DateHeader, KeepAliveHeader, PendingRequest, error_response
from zserve.frontends.fast_state import ENDING, ConnState, Event, advance
from zserve.frontends.resources import PredictRoute

if TYPE_CHECKING:
    from zserve.frontends.fast_busy import BusyConnection

log = logging.getLogger("zserve.frontend")

_PREFIX = b"/v1/models/"
_SUFFIX = b"/predict"
# Requests one connection may have waiting for answers (HTTP pipelining); the rest wait unparsed.
MAX_PIPELINED = 64
SWEEP_INTERVAL_S = 0.25
# After an answer that leaves request bytes unread (413, a malformed request): how long the connection keeps
# reading and dropping them before it closes. Closing a socket with unread bytes sends a reset, and the
# client may lose the answer it has not read yet.
LINGER_S = 2.0


# The states, as module names: compared on the hot path (a global load and an identity test each).
READING, HOLDING, HOLD_RESUMING = ConnState.READING, ConnState.HOLDING, ConnState.HOLD_RESUMING
HANDING_OVER, HANDOVER_SCHEDULED = ConnState.HANDING_OVER, ConnState.HANDOVER_SCHEDULED
FINAL, LINGER, CLOSED = ConnState.FINAL, ConnState.LINGER, ConnState.CLOSED


class FastHttpProtocol(asyncio.Protocol):
    """One HTTP/1.1 connection of a worker (see the module's docstring)."""

    def __init__(self, worker: Any, connections: FastConnections) -> None:
        self.worker = worker
        self.loop = worker.loop
        self.route: PredictRoute = worker.frontend.predict
        self.auth = worker.frontend.auth
        self.connections = connections
        self.parser = gunicorn_h1c.H1CProtocol(
            on_headers_complete=self._on_headers,
            on_body=self._on_body,
            on_message_complete=self._on_complete,
            limit_remaining=0,  # the bytes after a message are all kept: pipelined requests are never cut
            **connections.parser_limits,
        )
        self.transport: asyncio.Transport | None = None
        self.state = READING  # see fast_state.py; changed only through advance()
        self.queue: deque[PendingRequest] = deque()  # arrival order = answer order
        self._raw: list[bytes] | None = []  # the message's bytes until it is known to be ours
        self._current: PendingRequest | None = None  # the message being parsed, when it is ours
        self._parsed: PendingRequest | None = None  # ... once parsed whole, until it is submitted
        self._held: bytes | None = None  # bytes kept unparsed (HOLDING, HOLD_RESUMING)
        # Flow control, apart from the state: what the transport was last told (reading) and told us (writing).
        self._reading = True
        self._writing = True
        self.seen = True  # bytes arrived since the last sweep (the accept counts: it is no idle time)
        self.idle_s = 0.0
        self.head_s = 0.0  # how long the request head being read has taken so far, from its first byte (sweeps)
        # Counted here, when accepted, not in connection_made: asyncio builds the protocols of a whole accept burst
        # before any connection_made runs, and the limit (FastConnections.full) must see each one of them.
        # Uncounted once: in connection_lost, or at the hand-over (the ASGI protocol counts it again).
        gunicorn_internals.connection_opened(worker)

    def _advance(self, event: Event) -> None:
        self.state = advance(self.state, event)

    # ---- asyncio ----
    # No eof_received: a client that shuts its side has hung up, as far as HTTP goes (clients do not half-close),
    # and what it still waits for is cancelled in the broker (asyncio's default closes the transport).

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.connections.open.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.state is CLOSED:
            return
        self._advance(Event.LOST)
        self.connections.open.discard(self)
        gunicorn_internals.connection_closed(self.worker)
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
        state = self.state
        if state is READING:
            self._feed(data)
        elif state is HOLDING or state is HOLD_RESUMING:
            self._held += data
        elif state is HANDING_OVER or state is HANDOVER_SCHEDULED:  # behind a request for the ASGI app
            self._raw.append(data)
        # else a request that will not be answered (FINAL, LINGER, closing): dropped

    def _feed(self, data: bytes) -> None:
        parser = self.parser
        while True:
            if self._raw is not None:
                self._raw.append(data)
            try:
                parser.feed(data)
            except Exception as exc:  # gunicorn_h1c's parse errors and limits (ValueErrors), or a bug of ours
                return self._bad_request(exc)
            if self.state is HANDING_OVER:
                if not self.queue:
                    self._hand_over()
                else:
                    self._pause_reading()  # the answers before it go first
                return
            request = self._parsed
            if request is None or self.state is not READING:  # not whole yet, or refused (413) on the way
                return
            self._parsed = None
            self._current = None
            rest = parser.remaining()
            parser.reset()
            self._raw = []
            self._submit(request)
            if not request.keep_alive:
                self._advance(Event.LAST_REQUEST)  # the client said close: what follows is not read
            if not rest or self.state is not READING:
                return
            if len(self.queue) >= MAX_PIPELINED:
                self._held = rest
                self._advance(Event.HOLD)
                self._pause_reading()
                return
            data = rest

    def _feed_held(self) -> None:
        if self.state is not HOLD_RESUMING:  # closed meanwhile
            return
        self._advance(Event.FEED_HELD)
        held, self._held = self._held, None
        self._feed(held)
        if len(self.queue) < MAX_PIPELINED // 2:
            self._resume_reading()

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
        # A request with a priority header goes to the falcon route, which reads it (the fast path's requests carry
        # none: their priority is their API key's).
        if handler is None or parser.get_header(b"x-zserve-priority") is not None:
            self._advance(Event.HANDOVER_REQUEST)
            return False
        self._raw = None
        request = self._current = PendingRequest(self, name, handler, parser.should_keep_alive)
        request.http10 = parser.http_version == (1, 0)
        request.content_type = (parser.get_header(b"content-type") or b"").decode("latin-1")
        if self.auth is not None:
            header = parser.get_header(b"authorization")
            request.auth_header = None if header is None else header.decode("latin-1")
        length = parser.content_length  # None: chunked, or no body
        if length is not None and length > self.route.max_body_bytes:
            self._too_large(request)
        elif (parser.get_header(b"expect") or b"").lower() == b"100-continue" and not request.http10:
            if self.queue:
                request.wants_continue = True  # once the answers before it are out
            else:
                self.transport.write(CONTINUE)
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
            self._parsed = self._current

    # ---- requests ----

    def _too_large(self, request: PendingRequest) -> None:
        """Answer 413 at once; the rest of the body is never parsed, and the connection ends."""
        self._current = None
        self._advance(Event.REFUSED)
        self.queue.append(request)
        request.keep_alive = False
        message = f"body is over {self.route.max_body_bytes} bytes"
        request.answer(413, error_response(413, "payload_too_large", message, connection=CLOSE))

    def _submit(self, request: PendingRequest) -> None:
        self.queue.append(request)
        route = self.route
        caller = ANONYMOUS
        if self.auth is not None:
            refusal = self.auth.refusal(f"/v1/models/{request.name}/predict", request.auth_header)
            if refusal is not None:
                return request.deliver(error_response(401, "invalid_api_key", refusal, connection=request.connection()))
            caller = self.auth.caller(request.auth_header)
        try:
            raw = request.chunks[0] if len(request.chunks) == 1 else b"".join(request.chunks)
            request.chunks = []
            item = route.item(request.handler, raw, request.content_type)
            if caller is ANONYMOUS:
                request.req_id = route.client.start(request.name, item, request, decoded=True)
            else:
                request.req_id = route.client.start(request.name, item, request, decoded=True,
                                                    priority=caller.priority, tenant=caller.tenant)  # fmt: skip
        except Exception as exc:
            return request.fail(exc)

    def _bad_request(self, exc: Exception) -> None:
        """Answer a request that cannot be parsed (after those before it), then end the connection."""
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
        self._advance(Event.REFUSED)
        request = PendingRequest(self, "", None, keep_alive=False)
        self.queue.append(request)
        request.deliver(error_response(status, type_name, message, connection=CLOSE))

    def write_answered(self) -> None:
        """Write every answered request at the head of the queue (answers leave in arrival order)."""
        queue = self.queue
        state = self.state
        if state in ENDING or not queue or queue[0].out is None:
            return
        transport = self.transport
        worker = self.worker
        while queue and queue[0].out is not None:
            request = queue.popleft()
            transport.write(request.out)
            # gunicorn's --max-requests, on its worker's fields (gunicorn_internals.WORKER_FIELDS), inline: per request
            worker.nr += 1
            if worker.nr >= worker.max_requests and worker.alive:
                log.info("Autorestarting worker after current request.")
                worker.alive = False
            if not request.keep_alive:
                return self._end()
        if queue:
            if len(queue) < MAX_PIPELINED // 2:
                self._resume_reading()
            return
        state = self.state
        if state is HANDING_OVER:
            # Not from inside the client's reply dispatch: gunicorn's protocol starts on the next turn.
            self._advance(Event.ANSWERS_OUT)
            self.loop.call_soon(self._hand_over)
        elif state is not HANDOVER_SCHEDULED:
            current = self._current
            if current is not None and current.wants_continue:
                current.wants_continue = False
                transport.write(CONTINUE)
            self._resume_reading()

    # ---- connection ----

    def _hand_over(self) -> None:
        """Give the connection, with the unanswered request's bytes, to gunicorn's ASGI protocol."""
        state = self.state
        if state in ENDING:
            return
        raw, self._raw = b"".join(self._raw or ()), None
        self._advance(Event.HANDED_OVER)
        self.connections.open.discard(self)
        gunicorn_internals.connection_closed(self.worker)  # the ASGI protocol counts it again
        if not self._reading:
            self.transport.resume_reading()
        protocol = gunicorn_internals.hand_over(self.worker, self.transport, raw, writing_paused=not self._writing)
        self.connections.handed_over.add(protocol)

    def _pause_reading(self) -> None:
        if self._reading and self.state is not CLOSED:
            self._reading = False
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._reading or not self._writing:
            return
        state = self.state
        if state is READING:
            self._reading = True
            self.transport.resume_reading()
        elif state is HOLDING:  # parsed first, on the next turn; reading resumes after, with room
            self._advance(Event.RESUME_HELD)
            self.loop.call_soon(self._feed_held)
        # else handing over, a last answer queued, or closing: reading stays paused

    def _end(self) -> None:
        """Close after the last answer; with request bytes left unread, read and drop them a while first."""
        transport = self.transport
        if self.state is not LINGER or not transport.can_write_eof():
            self._advance(Event.CLOSE)
            return transport.close()  # connection_lost follows, once what was written is flushed
        self._advance(Event.CLOSE_LINGERING)
        transport.write_eof()
        if not self._reading:
            self._reading = True
            transport.resume_reading()
        self.loop.call_later(LINGER_S, transport.close)

    def abort(self) -> None:
        self._advance(Event.CLOSE)
        self.transport.abort()

    def sweep(self, interval_s: float, keepalive_s: float, draining: bool) -> None:
        """Close this connection if it has been idle past ``keepalive_s``, or, once the worker has stopped
        accepting (``draining``), past one sweep interval with no request in progress (FastConnections.drain
        says why that is safe). A request in progress then is served, and its answer ends the connection
        (``Connection: close``, PendingRequest.connection).

        A request head has ``keepalive_s`` from its first byte to arrive whole (nginx's client_header_timeout),
        else 408: the idle time alone restarts on every byte, so a head dripped a byte at a time would hold the
        connection for ever."""
        state = self.state
        if self.queue or state in ENDING:
            return
        begun = state is READING and (self._current is not None or self._raw)  # ``_raw``: a head's bytes so far
        if state is READING and self._raw:
            self.head_s += interval_s
            if self.head_s >= keepalive_s:
                return self._timed_out(f"the request head was not sent whole within {keepalive_s:g} s")
        else:
            self.head_s = 0.0
        # ``seen`` stays set while requests wait (the early return above), so the idle time counts from the
        # sweep after the last answer: a full interval of idle time is one with no byte in or out.
        if self.seen:
            self.seen = False
            self.idle_s = 0.0
        else:
            self.idle_s += interval_s
        if self.idle_s >= keepalive_s:
            if begun:
                return self._timed_out(f"the request was not sent whole within {keepalive_s:g} s")
            self._end()
        elif draining and self.idle_s >= interval_s and state is READING and not begun:
            self._end()

    def _timed_out(self, message: str) -> None:
        """A request begun and not sent whole in time: answered 408, never closed on in silence."""
        self._current = None
        self._advance(Event.REFUSED)
        request = PendingRequest(self, "", None, keep_alive=False)
        self.queue.append(request)
        request.deliver(error_response(408, "request_timeout", message, connection=CLOSE))


class FastConnections:
    """A worker's connections, swept every SWEEP_INTERVAL_S: idle keep-alive connections close after gunicorn's
    ``--keep-alive`` seconds, or at once when the worker stops (``drain``), and the Date header is refreshed.
    Past ``--worker-connections`` open ones, a new connection is a BusyConnection (fast_busy.py): its request
    is answered 503."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.open: set[FastHttpProtocol] = set()
        # Connections given to gunicorn's ASGI protocol (the falcon app's): only a stopping worker looks at them.
        # Weak: gunicorn's protocol says nothing to us when its connection ends.
        self.handed_over: weakref.WeakSet[asyncio.Protocol] = weakref.WeakSet()
        # BusyConnections open: counted in the worker's connections, not against the limit
        self.busy: set[BusyConnection] = set()
        self.parser_limits = gunicorn_internals.parser_limits(worker)  # gunicorn's request limits
        self.max_connections = gunicorn_internals.max_connections(worker)
        self.refused = 0  # requests answered 503 for the limit
        self._refused_logged = 0
        KeepAliveHeader.set(gunicorn_internals.advertised_keepalive_s(worker))

    def full(self) -> bool:
        """Whether a connection accepted now is one too many (the falcon path's connections count too)."""
        return gunicorn_internals.open_connections(self.worker) - len(self.busy) >= self.max_connections

    async def sweep(self) -> None:
        keepalive_s = gunicorn_internals.keepalive_s(self.worker)
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            DateHeader.refresh()
            draining = gunicorn_internals.stopped_accepting(self.worker)
            for conn in list(self.open):
                conn.sweep(SWEEP_INTERVAL_S, keepalive_s, draining)
            if draining:
                self.drain()
            if self.refused > self._refused_logged:  # one line per sweep, not one per refused connection
                log.warning("%d requests answered 503: this worker holds %d connections ([frontends] max_connections)",
                            self.refused - self._refused_logged, self.max_connections)  # fmt: skip
                self._refused_logged = self.refused

    def drain(self) -> None:
        """The worker has stopped accepting (its graceful shutdown waits for every open connection): close the
        connections of the falcon app and the refused ones that have no request in progress, as FastHttpProtocol's
        sweep closes its own, instead of leaving each to its ``--keep-alive`` time.

        As uvicorn (``Server.shutdown`` closes its listeners, then ``connection.shutdown()`` closes every
        connection with no request cycle in progress, and marks the rest keep_alive=False) and nginx (idle
        keep-alive connections close when a worker quits gracefully). HTTP/1.1 lets a server close an idle
        connection at any time (RFC 9112 9.3.1, 9.6). What remains is the race of a client that sends on the
        connection as it closes: that request meets a closed socket and its client must retry (the openai
        client retries on connection errors; plain httpx raises them to its caller, but finds a pooled connection
        closed before reusing it). Two things narrow it: only connections idle for a whole sweep interval (no
        byte in or out, nothing begun) are closed, so a client reusing its connection at once is answered with
        ``Connection: close`` instead; and only once the listeners are closed, so nothing new arrives on this
        worker meanwhile.
        (gunicorn's own gthread worker, for the same race, keeps a stopping worker's idle connections open 2 s
        at most, STOP_KEEPALIVE_LINGER; uvicorn closes them at once.)"""
        now_s = self.worker.loop.time()
        for protocol in list(self.handed_over):
            gunicorn_internals.close_if_idle(protocol, now_s, SWEEP_INTERVAL_S)
        for conn in list(self.busy):
            conn.drain(now_s, SWEEP_INTERVAL_S)

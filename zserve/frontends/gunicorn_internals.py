"""Every part of gunicorn the fast HTTP path uses beyond its documented settings and server hooks, in one place:
gunicorn's ``asgi`` worker class and two of its private methods, the module-level name it builds each
connection's protocol with, its ASGI protocol (for the handover, and its idle state and idle close for a
stopping worker), and fields of its worker objects.

gunicorn documents none of these: a release may move them. ``problems`` lists what the installed gunicorn lacks,
each named with the attribute and gunicorn's version; a worker refuses to start on any (``require``), and
tests/unit/test_gunicorn_internals.py fails on them, so an upgrade breaks loudly there and not silently in
production (a patched name nobody looks up any more would leave every request on the slow path). pyproject.toml
bounds gunicorn below its next major release. What only the prompt close of idle falcon-path connections at a stop
uses is listed apart (``idle_close_problems``): without it a worker serves, and such connections wait out their
keep-alive at a stop (gunicorn 27.0.0, the floor, lacks one).

The per-request fields (``nr``, ``max_requests``, ``alive``, see WORKER_FIELDS) are read and written inline by
``fast_http.py`` and ``fast_answers.py``: a function call here per request would cost more than the write.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Coroutine
from types import CodeType
from typing import Any

import gunicorn
from gunicorn.asgi.protocol import ASGIProtocol
from gunicorn.workers import gasgi

log = logging.getLogger("zserve.frontend")

VERSION = gunicorn.__version__

# Fields of a booted asgi worker the fast path uses, and why.
WORKER_FIELDS = {
    "loop": "the worker's event loop (set by init_process)",
    "cfg": "gunicorn's settings (keepalive, request limits)",
    "asgi": "the loaded app (set by load_wsgi)",
    "nr_conns": "open connections: graceful shutdown waits for them",
    "nr": "requests answered, for --max-requests",
    "max_requests": "--max-requests with its jitter (sys.maxsize when off)",
    "alive": "False once the worker stops: answers then close their connection",
    "servers": "its listeners (asyncio servers): closed when it stops accepting, before its graceful shutdown",
}
# Settings read off ``worker.cfg`` (documented settings, read here so that one place names them).
CONFIG_FIELDS = (
    "keepalive",
    "worker_connections",
    "limit_request_line",
    "limit_request_fields",
    "limit_request_field_size",
)
# The ASGI protocol's side of a handover (asyncio.Protocol's methods, as gunicorn implements them).
PROTOCOL_METHODS = ("connection_made", "data_received", "pause_writing", "resume_writing", "connection_lost")
_PROTOCOL_NAME = "ASGIProtocol"  # gasgi's module-level name for it, looked up per connection
# The ASGI protocol's private state a stopping worker reads to close an idle handed-over connection, set in its
# __init__ (see close_if_idle), and its private methods _note_reads wraps and close_if_idle calls.
PROTOCOL_FIELDS = {
    "worker": "the worker it serves (its loop and settings)",
    "_awaiting_request": "True while it waits for the next request's head",
    "_keepalive_handle": "the idle timer: armed while no request and no application call is in progress",
    "_closed": "True once it is closing",
}
PROTOCOL_PRIVATE_METHODS = {
    "_feed_callback_parser": "feeds the parser: every read, and the bytes pipelined behind a request",
    "_on_message_complete": "the parser's callback at the end of a request (looked up when the parser is built)",
    "_arm_keepalive_timer": "called when the connection goes idle",
    "_keepalive_timeout": "how it closes an idle connection when --keep-alive expires",
}
# Where gunicorn 27.0.1 calls those methods through ``self`` (what the instance wrappers rely on): every read and the
# re-feed of bytes pipelined behind a request go through _feed_callback_parser; _on_message_complete is looked up
# when the parser is built; the idle timer is armed when a request ends and when a call left running ends.
PROTOCOL_CALLS = {
    "data_received": ("_feed_callback_parser",),
    "_handle_connection": ("_feed_callback_parser", "_arm_keepalive_timer"),
    "_setup_callback_parser": ("_on_message_complete",),
    "_finishing_call_done": ("_arm_keepalive_timer",),
}


class AsgiWorker(gasgi.ASGIWorker):
    """gunicorn's asgi worker with two hooks: ``app_loaded`` once the app is built (after gunicorn's own
    ``load_wsgi``), and ``background`` run as a task while the worker serves (around gunicorn's ``_serve``)."""

    def app_loaded(self, app: Any) -> None:
        pass

    def background(self) -> Coroutine[Any, Any, None] | None:
        return None

    def load_wsgi(self) -> None:
        super().load_wsgi()
        require(self)
        self.app_loaded(self.asgi)

    async def _serve(self) -> None:
        work = self.background()
        task = None if work is None else self.loop.create_task(work)
        try:
            await super()._serve()
        finally:
            if task is not None:
                task.cancel()


def install_protocol_factory(worker_class: type, factory: Callable[[Any], asyncio.Protocol]) -> None:
    """Make ``factory(worker)`` the protocol of every connection a ``worker_class`` worker accepts.

    gunicorn's asgi worker builds each connection's protocol as ``ASGIProtocol(worker)``, a name it looks up in
    its module when a connection arrives; there is no setting for it. So that name is replaced: our workers get
    ``factory``'s protocol, any other worker of this process gunicorn's own, as before."""
    original = getattr(gasgi, _PROTOCOL_NAME)

    def protocol_for(worker: Any) -> Any:
        if isinstance(worker, worker_class):
            return factory(worker)
        return original(worker)

    setattr(gasgi, _PROTOCOL_NAME, protocol_for)


def hand_over(worker: Any, transport: asyncio.Transport, raw: bytes, writing_paused: bool) -> ASGIProtocol:
    """Give a connection, with the bytes read and not answered yet, to gunicorn's ASGI protocol; the caller has
    stopped counting it (``connection_closed``), and the protocol counts it again."""
    protocol = ASGIProtocol(worker)
    _note_reads(protocol)  # before connection_made: the parser it builds looks _on_message_complete up then
    transport.set_protocol(protocol)
    protocol.connection_made(transport)
    if writing_paused:
        protocol.pause_writing()  # the transport will say when to resume, to the new protocol
    if raw:
        protocol.data_received(raw)
    return protocol


def _note_reads(protocol: ASGIProtocol) -> None:
    """Have ``protocol`` count its reads, and note when it goes idle and whether a read came after its last request
    ended: that is a request head begun (gunicorn's C parser does not say so, and a whole one would not leave the
    protocol idle), which a stopping worker must not close under.

    On the instance, before the parser is built (connection_made: it looks _on_message_complete up then): a
    subclass would not do, as gunicorn caches which parser it may use on the class it asks. A read is a call of
    _feed_callback_parser, which every network read goes through and, once a request is answered, the bytes
    pipelined behind it too: so a head begun in the same read as the last request's end, or in the fast path's
    handover bytes, counts as begun. That gunicorn calls these through ``self`` is checked (PROTOCOL_CALLS)."""
    if not IDLE_CLOSE:
        return
    feed = protocol._feed_callback_parser
    message_complete = protocol._on_message_complete
    arm_idle_timer = protocol._arm_keepalive_timer
    loop = protocol.worker.loop
    protocol.reads = 0
    protocol.reads_at_message_end = 0
    protocol.idle_reads = -1  # reads when it went idle with nothing begun; -1: not idle since its first request
    protocol.idle_since_s = 0.0

    def feed_callback_parser(data: bytes) -> bool:
        protocol.reads += 1  # a network read, or the re-feed of bytes pipelined behind the last request
        return feed(data)

    def on_message_complete() -> None:
        protocol.reads_at_message_end = protocol.reads
        message_complete()

    def arm_keepalive_timer() -> None:
        # A read since the last request ended began the next one: it stays begun (reads != idle_reads).
        protocol.idle_reads = protocol.reads_at_message_end
        protocol.idle_since_s = loop.time()
        arm_idle_timer()

    protocol._feed_callback_parser = feed_callback_parser
    protocol._on_message_complete = on_message_complete
    protocol._arm_keepalive_timer = arm_keepalive_timer


def close_if_idle(protocol: ASGIProtocol, now_s: float, min_idle_s: float) -> bool:
    """Close a handed-over connection that has had no request in progress for ``min_idle_s`` (see
    ``FastConnections.drain``), the way gunicorn closes it when ``--keep-alive`` expires; whether it did.

    Idle is gunicorn's own word for it: its idle timer is armed only while the protocol waits for a request and no
    application call runs (a response still being sent, a body still being read, keep it disarmed). A head begun
    (``_note_reads``) keeps the connection: that request is served, and its answer says ``Connection: close``, the
    worker no longer being alive."""
    if not IDLE_CLOSE:
        return False
    if protocol._closed or not protocol._awaiting_request or protocol._keepalive_handle is None:
        return False
    if protocol.reads != protocol.idle_reads or now_s - protocol.idle_since_s < min_idle_s:
        return False
    protocol._keepalive_timeout()
    return True


def stopped_accepting(worker: Any) -> bool:
    """Whether the worker has closed its listeners (its graceful shutdown has begun: gunicorn closes them first,
    then waits for the open connections)."""
    servers = worker.servers
    return bool(servers) and not any(server.is_serving() for server in servers)


def connection_opened(worker: Any) -> None:
    worker.nr_conns += 1


def connection_closed(worker: Any) -> None:
    worker.nr_conns -= 1


def open_connections(worker: Any) -> int:
    return worker.nr_conns


def keepalive_s(worker: Any) -> float:
    return float(worker.cfg.keepalive)


def advertised_keepalive_s(worker: Any) -> int:
    """The idle timeout answers advertise (``Keep-Alive: timeout=N``): one second below ``--keep-alive``, the
    idle time after which a connection is really closed (the supervisor passes ``[frontends] keep_alive_s`` + 1).
    A client that reuses a connection just inside the advertised time then never races the server's close."""
    return max(1, int(worker.cfg.keepalive) - 1)


def max_connections(worker: Any) -> int:
    """``--worker-connections``: the open connections past which a new one is answered 503 (gunicorn's asgi
    worker itself does not enforce it)."""
    return int(worker.cfg.worker_connections)


def parser_limits(worker: Any) -> dict[str, int]:
    """gunicorn's request limits, as gunicorn_h1c's parser takes them."""
    cfg = worker.cfg
    return {
        "limit_request_line": cfg.limit_request_line or (1 << 20),  # 0 = unlimited in gunicorn's terms
        "limit_request_fields": cfg.limit_request_fields,
        "limit_request_field_size": cfg.limit_request_field_size,
    }


# ---- the contract ----


def _names_looked_up(code: CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, CodeType):  # the lambda that builds the protocol
            names |= _names_looked_up(const)
    return names


def class_problems() -> list[str]:
    """What this module needs of gunicorn's classes and modules and the installed gunicorn lacks."""
    found = []
    base = gasgi.ASGIWorker
    serve = getattr(base, "_serve", None)
    if serve is None or not inspect.iscoroutinefunction(serve):
        found.append("gunicorn.workers.gasgi.ASGIWorker._serve (a coroutine method: the worker's serve loop)")
    elif _PROTOCOL_NAME not in _names_looked_up(serve.__code__):
        found.append(
            f"gunicorn.workers.gasgi.ASGIWorker._serve no longer builds connections with the module name "
            f"{_PROTOCOL_NAME}: the fast path would never be installed"
        )
    if not hasattr(gasgi, _PROTOCOL_NAME):
        found.append(f"gunicorn.workers.gasgi.{_PROTOCOL_NAME} (the name each connection's protocol is built with)")
    if "load_wsgi" not in vars(base):
        found.append("gunicorn.workers.gasgi.ASGIWorker.load_wsgi (where it sets worker.asgi)")
    params = list(inspect.signature(ASGIProtocol).parameters)
    if params != ["worker"]:
        found.append(f"gunicorn.asgi.protocol.ASGIProtocol(worker): its parameters are now {params}")
    found += [
        f"gunicorn.asgi.protocol.ASGIProtocol.{name}" for name in PROTOCOL_METHODS if not hasattr(ASGIProtocol, name)
    ]
    return [f"gunicorn {VERSION}: {p}" for p in found]


def idle_close_problems() -> list[str]:
    """What closing an idle handed-over connection at once when a worker stops (``close_if_idle``) needs of
    gunicorn's ASGI protocol and the installed gunicorn lacks (27.0.0, the floor, lacks ``_awaiting_request``).
    Not a reason to refuse to serve: without them such a connection waits out its ``--keep-alive`` at a stop, as
    it always did (``require`` logs them once).

    The wrappers ``_note_reads`` puts on an instance count only where gunicorn calls those methods through
    ``self``: a release that fed its parser, or ended a request, some other way would have a head begun taken for
    idle. So the call sites are checked too (PROTOCOL_CALLS)."""
    found = [
        f"gunicorn.asgi.protocol.ASGIProtocol.{name}: {why}"
        for name, why in PROTOCOL_PRIVATE_METHODS.items()
        if not callable(getattr(ASGIProtocol, name, None))
    ]
    for caller, callees in PROTOCOL_CALLS.items():
        method = getattr(ASGIProtocol, caller, None)
        looked_up = _names_looked_up(method.__code__) if hasattr(method, "__code__") else set()
        found += [
            f"gunicorn.asgi.protocol.ASGIProtocol.{caller} no longer calls self.{callee}"
            for callee in callees
            if callee not in looked_up
        ]
    stored = _names_looked_up(ASGIProtocol.__init__.__code__)
    found += [
        f"gunicorn.asgi.protocol.ASGIProtocol().{name}: {why}"
        for name, why in PROTOCOL_FIELDS.items()
        if name not in stored
    ]
    return [f"gunicorn {VERSION}: {p}" for p in found]


IDLE_CLOSE = not idle_close_problems()  # whether a stopping worker closes idle falcon-path connections at once


def worker_problems(worker: Any) -> list[str]:
    """What this module needs of a booted asgi worker (after load_wsgi) and ``worker`` lacks."""
    found = [f"worker.{name}: {why}" for name, why in WORKER_FIELDS.items() if not hasattr(worker, name)]
    cfg = getattr(worker, "cfg", None)
    if cfg is not None:
        found += [f"worker.cfg.{name}" for name in CONFIG_FIELDS if not hasattr(cfg, name)]
    return [f"gunicorn {VERSION}: {p}" for p in found]


def require(worker: Any) -> None:
    """Refuse to serve on a gunicorn whose internals moved (called by every worker once its app is loaded)."""
    found = class_problems() + worker_problems(worker)
    if found:
        raise RuntimeError("zserve's fast HTTP path does not fit this gunicorn:\n  " + "\n  ".join(found))
    if not IDLE_CLOSE:
        log.info(
            "a stopping worker leaves idle connections of the falcon app to their --keep-alive on this gunicorn:\n  %s",
            "\n  ".join(idle_close_problems()),
        )

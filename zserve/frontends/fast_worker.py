"""The gunicorn worker class of zserve's frontends: gunicorn's ``asgi`` worker (its master, signals,
graceful shutdown, the inherited listening socket, the falcon app through its ASGI protocol), with the fast
HTTP path of ``fast_http.py`` as the protocol of every new connection. What this takes of gunicorn's internals
is in ``gunicorn_internals.py``.

Run as ``gunicorn --worker-class zserve.frontends.fast_worker.FastPathWorker
zserve.frontends.app:create_frontend()`` (the supervisor's command line, ``servers.py``).
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

from zserve.frontends import gunicorn_internals
from zserve.frontends.app import Frontend
from zserve.frontends.fast_busy import BusyConnection
from zserve.frontends.fast_http import FastConnections, FastHttpProtocol


class FastPathWorker(gunicorn_internals.AsgiWorker):
    frontend: Frontend
    connections: FastConnections

    def app_loaded(self, app: Any) -> None:
        if not isinstance(app, Frontend):
            name = type(app).__name__
            raise RuntimeError(f"FastPathWorker serves zserve.frontends.app:create_frontend(), not {name}")
        self.frontend = app
        self.connections = FastConnections(self)

    def background(self) -> Coroutine[Any, Any, None]:
        return self.connections.sweep()


def _fast_protocol(worker: FastPathWorker) -> FastHttpProtocol | BusyConnection:
    if worker.connections.full():
        return BusyConnection(worker, worker.connections)
    return FastHttpProtocol(worker, worker.connections)


gunicorn_internals.install_protocol_factory(FastPathWorker, _fast_protocol)

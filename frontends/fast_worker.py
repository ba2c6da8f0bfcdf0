"""The gunicorn worker class of zserve's frontends: gunicorn's ``asgi`` worker (its master, signals,
graceful shutdown, the inherited listening socket, the falcon app through its ASGI protocol), with the fast
HTTP path of ``fast_http.py`` as the protocol of every new connection.

Run as ``gunicorn --worker-class zserve.frontends.fast_worker.FastPathWorker
zserve.frontends.app:create_frontend()`` (the supervisor's command line, ``servers.py``).
"""

from __future__ import annotations

from typing import Any

from gunicorn.workers import gasgi

from zserve.frontends.app import Frontend
from zserve.frontends.fast_http import FastConnections, FastHttpProtocol


class FastPathWorker(gasgi.ASGIWorker):
    frontend: Frontend
    connections: FastConnections

    def load_wsgi(self) -> None:
        super().load_wsgi()
        if not isinstance(self.asgi, Frontend):
            raise RuntimeError(
                f"FastPathWorker serves zserve.frontends.app:create_frontend(), not {type(self.asgi).__name__}"
            )
        self.frontend = self.asgi
        self.connections = FastConnections(self)

    async def _serve(self) -> None:
        sweep = self.loop.create_task(self.connections.sweep())
        try:
            await super()._serve()
        finally:
            sweep.cancel()


# gunicorn's asgi worker builds each connection's protocol as ``ASGIProtocol(worker)``, a name it looks up
# in its module when a connection arrives; there is no setting for it. Our workers get the fast path, any
# other worker of this process its own protocol, as before.
_asgi_protocol = gasgi.ASGIProtocol


def _protocol_for(worker: Any) -> Any:
    if isinstance(worker, FastPathWorker):
        return FastHttpProtocol(worker, worker.connections)
    return _asgi_protocol(worker)


gasgi.ASGIProtocol = _protocol_for

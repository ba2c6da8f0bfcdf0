"""The command line of the HTTP server that runs the falcon ASGI app: gunicorn (its asgi worker with zserve's
fast predict path, ``fast_worker.FastPathWorker``) or granian (a Rust HTTP server), chosen by ``[frontends]
server``. Both build the app once per worker process and stop gracefully on SIGTERM within
``graceful_timeout_s``. Under ``zserve up`` gunicorn serves a listening socket the supervisor bound
(``listen_socket``, passed as ``fd://N``), so a master that dies and restarts refuses no connection: they
wait in the backlog. granian cannot take an inherited socket (no such option; on Linux each of its workers
binds its own SO_REUSEPORT socket), so it binds ``host:port`` itself, as gunicorn does under supervisord."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from zserve.config import FrontendsConfig

FRONTEND_FACTORY = "zserve.frontends.app:create_frontend"  # the app and the fast path's predict route
WORKER_CLASS = "zserve.frontends.fast_worker.FastPathWorker"
GRANIAN_APP_FACTORY = "zserve.frontends.granian_app:create_app"  # + cancel on client hang-up


# Connections that arrive while no server accepts (a master restarting) wait here: a few seconds of a
# busy port's arrivals. Linux caps it at net.core.somaxconn (4096 since 5.4).
LISTEN_BACKLOG = 2048


def listen_socket(host: str, port: int, backlog: int = LISTEN_BACKLOG) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening, for the supervisor to own and hand to gunicorn."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # rebind over a previous run's TIME_WAIT
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def server_argv(f: FrontendsConfig, pid_file: Path, listen_fd: int | None = None) -> list[str]:
    """``listen_fd``: a listening socket the caller owns and passes to the child (gunicorn only)."""
    if f.server == "granian":
        return _granian(f, pid_file)
    return _gunicorn(f, pid_file, listen_fd)


def _gunicorn(f: FrontendsConfig, pid_file: Path, listen_fd: int | None) -> list[str]:
    host = f"[{f.host}]" if ":" in f.host else f.host
    bind = f"fd://{listen_fd}" if listen_fd is not None else f"{host}:{f.port}"
    return [sys.executable, "-m", "gunicorn", "--worker-class", WORKER_CLASS, "--workers", str(f.workers),
            "--bind", bind, "--no-control-socket", "--http-parser", "fast",
            "--graceful-timeout", str(int(f.graceful_timeout_s)),
            "--asgi-disconnect-grace-period", "0", "--keep-alive", "5", "--error-logfile", "-",
            "--pid", str(pid_file), "-c", "python:zserve.frontends.gunicorn_conf",
            f"{FRONTEND_FACTORY}()"]  # fmt: skip


def _granian(f: FrontendsConfig, pid_file: Path) -> list[str]:
    # granian's master respawns a worker that dies (--respawn-failed-workers); it has no per-worker hooks,
    # so zserve.frontends.granian_main only adds die-with-parent before its CLI.
    return [sys.executable, "-m", "zserve.frontends.granian_main", "--interface", "asgi", "--factory",
            "--host", f.host, "--port", str(f.port), "--workers", str(f.workers), "--loop", "uvloop",
            "--http", "1", "--no-ws", "--respawn-failed-workers", "--respawn-interval", "0.5",
            "--workers-kill-timeout", str(max(1, int(f.graceful_timeout_s))), "--pid-file", str(pid_file),
            GRANIAN_APP_FACTORY]  # fmt: skip

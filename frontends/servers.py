"""The command line of the HTTP server that runs the falcon ASGI app: gunicorn (asgi worker class) or
granian (a Rust HTTP server), chosen by ``[frontends] server``. Both serve ``create_app()`` once per
worker process, bind ``host:port`` in the master, and stop gracefully on SIGTERM within
``graceful_timeout_s``."""

from __future__ import annotations

import sys
from pathlib import Path

from zserve.config import FrontendsConfig

APP_FACTORY = "zserve.frontends.app:create_app"
GRANIAN_APP_FACTORY = "zserve.frontends.granian_app:create_app"  # + cancel on client hang-up


def server_argv(f: FrontendsConfig, pid_file: Path) -> list[str]:
    if f.server == "granian":
        return _granian(f, pid_file)
    return _gunicorn(f, pid_file)


def _gunicorn(f: FrontendsConfig, pid_file: Path) -> list[str]:
    host = f"[{f.host}]" if ":" in f.host else f.host
    return [sys.executable, "-m", "gunicorn", "--worker-class", "asgi", "--workers", str(f.workers),
            "--bind", f"{host}:{f.port}", "--no-control-socket",
            "--graceful-timeout", str(int(f.graceful_timeout_s)),
            "--asgi-disconnect-grace-period", "0", "--keep-alive", "5", "--error-logfile", "-",
            "--pid", str(pid_file), "-c", "python:zserve.frontends.gunicorn_conf",
            f"{APP_FACTORY}()"]  # fmt: skip


def _granian(f: FrontendsConfig, pid_file: Path) -> list[str]:
    # granian's master respawns a worker that dies (--respawn-failed-workers) and keeps the socket; it has
    # no per-worker hooks, so zserve.frontends.granian_main only adds die-with-parent before its CLI.
    return [sys.executable, "-m", "zserve.frontends.granian_main", "--interface", "asgi", "--factory",
            "--host", f.host, "--port", str(f.port), "--workers", str(f.workers), "--loop", "uvloop",
            "--http", "1", "--no-ws", "--respawn-failed-workers", "--respawn-interval", "0.5",
            "--workers-kill-timeout", str(max(1, int(f.graceful_timeout_s))), "--pid-file", str(pid_file),
            GRANIAN_APP_FACTORY]  # fmt: skip

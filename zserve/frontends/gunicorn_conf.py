"""gunicorn hooks for zserve frontends (``-c python:zserve.frontends.gunicorn_conf``). Everything else is
passed on the command line by the supervisor."""

from __future__ import annotations

import os
from typing import Any

from zserve.frontend_reload import worker_exited_line, worker_ready_line
from zserve.transport import die_with_parent

worker_class = "zserve.frontends.fast_worker.FastPathWorker"  # gunicorn's asgi worker + the fast HTTP path
preload_app = False  # each worker builds its own ZeroMQ client after fork


def on_starting(server: Any) -> None:
    die_with_parent()


def post_fork(server: Any, worker: Any) -> None:
    # worker.age counts spawns: 1..N at start, then N+1, ... for replacements.
    os.environ["ZSERVE_FRONTEND_INDEX"] = str(worker.age)


def post_worker_init(worker: Any) -> None:
    # The app is built; the worker accepts next. The supervisor's rolling reload waits for this line.
    print(worker_ready_line(worker.pid), flush=True)


def child_exit(server: Any, worker: Any) -> None:
    print(worker_exited_line(worker.pid), flush=True)  # in the master, once the worker is reaped
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)

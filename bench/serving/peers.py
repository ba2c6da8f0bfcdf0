"""The peer servers as bench targets: mosec and service-streamer (multiprocess mode), started with the same
models, batch sizes, batch waits and torch threads as zserve's engines, and loaded by the same wrk script.

A peer runs only where it is installed (``make bench-env`` builds .venv-bench with both); elsewhere its
scenario is skipped with a note saying so.
"""

from __future__ import annotations

import importlib.util
import signal
import sys
import time
from pathlib import Path

from bench.common.catalog import thread_env
from bench.common.measure import MOSEC, STREAMER
from bench.common.paths import with_repo_path
from bench.common.procs import Managed, ProcessError, free_port, http_status

# scenario -> (the module that must be importable, the app module)
PEERS: dict[str, tuple[str, str]] = {
    MOSEC: ("mosec", "bench.serving.peer_mosec"),
    STREAMER: ("service_streamer", "bench.serving.peer_streamer"),
}
READY_TIMEOUT_S = 600.0


def missing(scenario: str) -> str | None:
    """Why ``scenario`` cannot run in this interpreter, or None when it can."""
    module = PEERS[scenario][0]
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed in {sys.executable}; run `make bench-env` and use .venv-bench/bin/python"
    return None


def peer_up(
    scenario: str, config_path: Path, models: list[str], threads: int, echo: bool = False
) -> tuple[Managed, str]:
    """Start the peer serving ``models`` of the deployment; return it and its base URL once it answers."""
    port = free_port()
    app = PEERS[scenario][1]
    env = with_repo_path(thread_env(threads))  # the spawned worker processes import the bench package
    env.update(PEER_CONFIG=str(config_path), PEER_MODELS=",".join(models), PEER_THREADS=str(threads))
    if scenario == MOSEC:
        # --timeout: a queue of 64 embeddings takes seconds; --capacity: mosec's queue bound, above any c here.
        argv = [sys.executable, "-m", app, "--address", "127.0.0.1", "--port", str(port), "--timeout", "60000",
                "--capacity", "4096", "--log-level", "warning"]  # fmt: skip
        # mosec does not stop on SIGTERM (reference notes) nor on SIGINT in good time: its process group is killed.
        managed = Managed(scenario, argv, env=env, stop_timeout_s=3.0, echo=echo, stop_signal=signal.SIGINT)
    else:
        argv = [sys.executable, "-m", app, "--port", str(port)]
        managed = Managed(scenario, argv, env=env, stop_timeout_s=10.0, echo=echo)
    managed.start()
    try:
        if scenario == STREAMER:
            managed.wait_for_line(r"^peer ready$", timeout_s=READY_TIMEOUT_S)
        deadline = time.monotonic() + READY_TIMEOUT_S
        # mosec answers GET / once its HTTP server is up; the first POST (bench's check_endpoint) then waits for
        # the workers to finish loading. gevent's server has no such route: any HTTP answer means it listens.
        while http_status("127.0.0.1", port, "/") is None:
            if not managed.running():
                code = managed.proc.poll() if managed.proc else None
                raise ProcessError(f"{scenario} exited (code {code}); its last output:\n{managed.tail()}")
            if time.monotonic() > deadline:
                raise ProcessError(f"{scenario} did not answer in {READY_TIMEOUT_S:.0f}s:\n{managed.tail()}")
            time.sleep(0.1)
    except BaseException:
        managed.close()
        raise
    managed.record_family()
    return managed, f"http://127.0.0.1:{port}"

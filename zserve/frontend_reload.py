"""Graceful reload of a gunicorn frontend (SIGHUP to ``zserve up``): its workers are replaced one at a
time, so the port keeps its full number of serving workers and no request fails.

gunicorn's own SIGHUP starts all N new workers and at once stops the N old ones gracefully: nothing
fails (the listening socket stays open, connections wait in its backlog), but until the new workers have
built their apps no one accepts. One at a time instead: SIGTTIN (the master adds a worker), wait for
that worker's ready line, SIGTTOU (the master stops its oldest worker with SIGTERM: it stops accepting
and finishes the requests it holds), wait for its exit line; N times. The lines come from the hooks in
``zserve.frontends.gunicorn_conf``, through the frontend's output that the supervisor reads anyway. The lines
are a protocol between the supervisor and the frontends' hooks, so they live here, below both.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import time

_READY = "frontend worker {pid} ready"
_EXITED = "frontend worker {pid} exited"
_EVENT = re.compile(r"frontend worker (\d+) (ready|exited)")


def worker_ready_line(pid: int) -> str:
    return _READY.format(pid=pid)


def worker_exited_line(pid: int) -> str:
    return _EXITED.format(pid=pid)


class ReloadError(RuntimeError):
    """The reload could not finish; the message says at which step."""


class RollingReload:
    """One reload of the gunicorn master ``master_pid`` with ``workers`` workers. Feed it every line of
    the frontend's output (``on_line``, from the supervisor's reader thread) and call ``run`` in a thread
    of its own; ``run`` returns the number of workers replaced or raises ReloadError."""

    def __init__(self, master_pid: int, workers: int, step_timeout_s: float) -> None:
        self.master_pid = master_pid
        self.workers = workers
        self.step_timeout_s = step_timeout_s  # a worker's boot, or an old worker's graceful stop
        self.events: queue.Queue[tuple[str, int]] = queue.Queue()

    def on_line(self, line: str) -> None:
        match = _EVENT.search(line)
        if match:
            self.events.put((match.group(2), int(match.group(1))))

    def _wait(self, kind: str, what: str) -> int:
        deadline = time.monotonic() + self.step_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ReloadError(f"no {what} within {self.step_timeout_s:.0f}s")
            try:
                event, pid = self.events.get(timeout=left)
            except queue.Empty:
                continue
            if event == kind:
                return pid

    def _signal(self, sig: signal.Signals) -> None:
        try:
            os.kill(self.master_pid, sig)
        except ProcessLookupError:
            raise ReloadError(f"the master (pid {self.master_pid}) is gone") from None

    def run(self) -> int:
        for _ in range(self.workers):
            self._signal(signal.SIGTTIN)
            self._wait("ready", "new worker ready")
            self._signal(signal.SIGTTOU)
            self._wait("exited", "old worker exit")
        return self.workers

"""Child processes that are always stopped: servers under test and helpers.

Every child runs in its own session (so a Ctrl-C in the terminal reaches only the bench, which then stops
the children in order) and gets SIGTERM from the kernel should the bench die without cleaning up (SIGKILL).
``Managed.close`` sends the polite signal, waits, then SIGKILLs the child's process group and any descendant
recorded while it ran; an ``atexit`` hook closes whatever is still open.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import http.client
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType, TracebackType

import psutil

from bench.common.catalog import thread_env
from bench.common.paths import REPO, VENV_BIN
from zserve.transport import free_tcp_port

_open: list[Managed] = []
_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
# Output lines worth reporting after a run (a server that logs errors under load is part of the result).
NOTABLE = re.compile(r"ERROR|CRITICAL|Traceback|WARNING|exited with code|restarting|did not stop|killing", re.I)
MAX_NOTABLE = 200


def _die_with_us() -> None:
    """In the child, before exec: SIGTERM it when the bench dies, even by SIGKILL (Linux only)."""
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class ProcessError(RuntimeError):
    """A child failed to start or become ready; the message carries the tail of its output."""


free_port = free_tcp_port


class Stopped(BaseException):
    """SIGTERM or SIGHUP arrived: unwind like Ctrl-C does (``finally`` blocks stop the children)."""


def stop_on_signals() -> None:
    """SIGTERM/SIGHUP raise Stopped; SIGINT raises KeyboardInterrupt even where it was inherited as ignored (a
    background job of a non-interactive shell)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def handler(signum: int, _frame: FrameType | None) -> None:
        raise Stopped(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, handler)


class Managed:
    """A child process whose output is kept (last lines) and can be waited on for a readiness line."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        stop_timeout_s: float = 30.0,
        echo: bool = False,
        stop_signal: signal.Signals = signal.SIGTERM,
    ) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.stop_timeout_s = stop_timeout_s
        self.stop_signal = stop_signal
        self.echo = echo
        self.proc: subprocess.Popen[bytes] | None = None
        self.lines: collections.deque[str] = collections.deque(maxlen=400)
        self.notable: list[str] = []
        self._watches: list[tuple[re.Pattern[str], list[re.Match[str]]]] = []
        self._cond = threading.Condition()
        self._family: dict[int, float] = {}  # pid -> create_time of every descendant seen
        self._pump: threading.Thread | None = None
        self.idle_cores = 0.0  # CPU the server uses with no load at all (see learn_idle); wait_idle allows it

    def __enter__(self) -> Managed:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_us,  # only a prctl call, through a libc loaded before the fork
        )
        _open.append(self)
        self._pump = threading.Thread(target=self._read, name=f"pump-{self.name}", daemon=True)
        self._pump.start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip()
            if self.echo:
                print(f"  [{self.name}] {line}", flush=True)
            with self._cond:
                self.lines.append(line)
                if NOTABLE.search(line) and len(self.notable) < MAX_NOTABLE:
                    self.notable.append(line)
                for regex, found in self._watches:
                    if not found and (match := regex.search(line)):
                        found.append(match)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 40) -> str:
        with self._cond:
            return self._tail_locked(n)

    def _tail_locked(self, n: int = 40) -> str:
        return "\n".join(list(self.lines)[-n:])

    def wait_for_line(self, pattern: str, timeout_s: float) -> re.Match[str]:
        """Wait until a line of output matches ``pattern``; raise if the child exits or time runs out."""
        regex = re.compile(pattern)
        found: list[re.Match[str]] = []
        deadline = time.monotonic() + timeout_s
        with self._cond:
            for line in self.lines:
                if match := regex.search(line):
                    return match
            self._watches.append((regex, found))
            try:
                while not found:
                    if not self.running():
                        raise ProcessError(
                            f"{self.name} exited (code {self.proc.poll() if self.proc else None}) "
                            f"before printing {pattern!r}; its last output:\n{self._tail_locked()}"
                        )
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ProcessError(
                            f"{self.name} did not print {pattern!r} in {timeout_s:.0f}s; its last "
                            f"output:\n{self._tail_locked()}"
                        )
                    self._cond.wait(min(left, 0.5))
            finally:
                self._watches.remove((regex, found))
        return found[0]

    def record_family(self) -> None:
        """Remember every current descendant, so that none can outlive ``close`` (they may be in other sessions)."""
        if not self.running():
            return
        try:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                try:
                    self._family[child.pid] = child.create_time()
                except psutil.Error:
                    pass
        except psutil.Error:
            pass

    def _processes(self) -> list[psutil.Process]:
        """The child and every live descendant recorded so far."""
        self.record_family()
        procs = []
        for pid, created in [(self.proc.pid, None), *self._family.items()] if self.proc else []:
            try:
                proc = psutil.Process(pid)
                if created is None or proc.create_time() == created:
                    procs.append(proc)
            except psutil.Error:
                pass
        return procs

    def cpu_by_role(self) -> dict[str, float]:
        """CPU seconds (user + system) used so far by the child and its descendants, summed by role."""
        totals: dict[str, float] = collections.defaultdict(float)
        for proc in self._processes():
            try:
                times = proc.cpu_times()
                totals[role_of(proc.cmdline())] += times.user + times.system
            except psutil.Error:
                pass
        return dict(totals)

    def cpu_by_process(self) -> dict[int, tuple[str, int, float]]:
        """pid -> (role, parent pid, CPU seconds used so far) of the child and each live descendant."""
        found: dict[int, tuple[str, int, float]] = {}
        for proc in self._processes():
            try:
                times = proc.cpu_times()
                found[proc.pid] = (role_of(proc.cmdline()), proc.ppid(), times.user + times.system)
            except psutil.Error:
                pass
        return found

    def learn_idle(self, window_s: float = 1.0) -> float:
        """Measure the CPU the server uses with no load (a peer whose workers poll their queues in a loop uses
        some), so that ``wait_idle`` waits for that level and not for zero."""
        before = sum(self.cpu_by_role().values())
        time.sleep(window_s)
        self.idle_cores = max(0.0, sum(self.cpu_by_role().values()) - before) / window_s
        return self.idle_cores

    def wait_idle(self, max_cores: float = 0.05, window_s: float = 0.25, timeout_s: float = 60.0) -> float:
        """Wait until the child and its descendants use less than ``max_cores`` of CPU (above ``idle_cores``) over
        ``window_s`` (work left over from the last load run is done); return the seconds waited. Gives up quietly
        after ``timeout_s``."""
        max_cores += self.idle_cores
        started = time.monotonic()
        before = sum(self.cpu_by_role().values())
        while time.monotonic() - started < timeout_s:
            time.sleep(window_s)
            after = sum(self.cpu_by_role().values())
            if after - before < max_cores * window_s:
                break
            before = after
        return time.monotonic() - started

    def close(self) -> list[str]:
        """Stop the child and its descendants; return a description of any that had to be killed as strays."""
        if self.proc is None:
            return []
        strays: list[str] = []
        try:
            self.record_family()
            if self.proc.poll() is None:
                try:
                    self.proc.send_signal(self.stop_signal)
                    self.proc.wait(timeout=self.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    print(
                        f"bench: {self.name} did not stop in {self.stop_timeout_s:.0f}s after "
                        f"{self.stop_signal.name}: killing it",
                        file=sys.stderr,
                        flush=True,
                    )
                except KeyboardInterrupt:
                    print(f"bench: interrupted while stopping {self.name}: killing it", file=sys.stderr, flush=True)
        finally:
            self._kill_group()
            strays = self._kill_family()
            if self._pump is not None:
                self._pump.join(timeout=2)
            if self in _open:
                _open.remove(self)
        return strays

    def _kill_group(self) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def _kill_family(self) -> list[str]:
        """Descendants still alive a moment after their ancestor stopped are strays: kill them by pid."""
        strays = []
        deadline = time.monotonic() + 3.0
        for pid, created in self._family.items():
            try:
                proc = psutil.Process(pid)
                if proc.create_time() != created:
                    continue  # the pid was reused by an unrelated process
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except psutil.TimeoutExpired:
                strays.append(f"pid {pid}: {' '.join(proc.cmdline())[:160]}")
                try:
                    proc.kill()
                except psutil.Error:
                    pass
            except psutil.Error:
                pass
        if strays:
            print(
                f"bench: WARNING {self.name} left {len(strays)} process(es) running; killed them:\n  "
                + "\n  ".join(strays),
                file=sys.stderr,
                flush=True,
            )
        return strays


@atexit.register
def _close_all() -> None:
    for managed in list(reversed(_open)):
        managed.close()


def role_of(cmdline: list[str]) -> str:
    """What a server process is, from its command line: broker, engine-MODEL, stage-MODEL, gunicorn, supervisor;
    for the peers (bench/serving/peers.py) mosec (its Rust HTTP server), mosec-main (its Python parent), web (the
    service-streamer web process) and worker (a peer's spawned model process)."""
    text = " ".join(cmdline)
    if "multiprocessing.spawn" in text:
        return "worker"
    if "peer_mosec" in text:
        return "mosec-main"
    if "peer_streamer" in text:
        return "web"
    if cmdline and Path(cmdline[0]).name == "mosec":
        return "mosec"
    if "zserve.broker" in text:
        return "broker"
    if match := re.search(r"--name (engine|stage)-(\S+)-\d+", text):
        return f"{match.group(1)}-{match.group(2)}"
    if "gunicorn" in text:
        return "gunicorn"
    if "zserve" in text:
        return "supervisor"
    return "other"


def http_status(host: str, port: int, path: str, timeout_s: float = 2.0) -> int | None:
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    except OSError:
        return None
    finally:
        conn.close()


def zserve_up(
    config_path: Path, startup_timeout_s: float, echo: bool = False, env: dict[str, str] | None = None
) -> tuple[Managed, str]:
    """Start ``zserve up -c config_path``; return it and its base URL once it prints its ready line."""
    # The supervisor drains frontends, then the broker, then engines, each with its own timeout; allow them all.
    managed = Managed(
        "zserve", [str(VENV_BIN / "zserve"), "up", "-c", str(config_path)], env=env, stop_timeout_s=60.0, echo=echo
    )
    managed.start()
    try:
        url = managed.wait_for_line(r"^zserve ready: (http://\S+)", timeout_s=startup_timeout_s).group(1)
    except BaseException:
        managed.close()
        raise
    managed.record_family()
    return managed, url


def naive_up(
    config_path: Path, models: list[str], port: int, workers: int, threads: int, ready_dir: Path, echo: bool = False
) -> tuple[Managed, str]:
    """Start the naive baseline (bench/serving/naive_app.py under gunicorn); return once every worker loaded its
    models."""
    env = thread_env(threads)
    env.update(
        NAIVE_CONFIG=str(config_path),
        NAIVE_MODELS=",".join(models),
        NAIVE_THREADS=str(threads),
        NAIVE_READY_DIR=str(ready_dir),
    )
    ready_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        "-m",
        "gunicorn",
        "--worker-class",
        "asgi",
        "--workers",
        str(workers),
        "--bind",
        f"127.0.0.1:{port}",
        "--no-control-socket",
        "--keep-alive",
        "5",
        "--graceful-timeout",
        "10",
        "--timeout",
        "120",
        "--error-logfile",
        "-",
        "--pythonpath",
        str(REPO),
        "bench.serving.naive_app:create_app()",
    ]
    # SIGINT is gunicorn's quick shutdown: what a worker still has queued from the last run is not worth waiting for.
    managed = Managed("naive", argv, env=env, stop_timeout_s=20.0, echo=echo, stop_signal=signal.SIGINT)
    managed.start()
    try:
        deadline = time.monotonic() + 600
        while len(list(ready_dir.glob("*.ready"))) < workers or http_status("127.0.0.1", port, "/readyz") != 200:
            if not managed.running():
                raise ProcessError(
                    f"the naive server exited (code {managed.proc.poll()}); its last output:\n{managed.tail()}"
                )
            if time.monotonic() > deadline:
                raise ProcessError(f"the naive server was not ready in 600s; its last output:\n{managed.tail()}")
            time.sleep(0.1)
    except BaseException:
        managed.close()
        raise
    managed.record_family()
    return managed, f"http://127.0.0.1:{port}"

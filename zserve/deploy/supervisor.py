"""``zserve up`` and ``zserve workers``: run a deployment plan (``zserve.deploy.plan``): start, watch and stop its
processes.

Order: broker -> engines -> (once every engine has registered) the gunicorn frontend -> one line
``zserve ready: http://HOST:PORT`` once /readyz answers 200. A child that dies is restarted with
exponential backoff; one that dies more than ``max_restarts`` times within ``restart_window_s`` makes
the supervisor give up loudly (stop everything, exit 1) rather than flap. The process table (pids,
start times, restarts) is published in RUN_DIR/state.json for `zserve status`. SIGTERM or Ctrl-C stops in
order (frontends, then the broker, which drains and tells engines to exit, then any straggler) and
exits 0 with nothing left running. SIGHUP replaces the frontend's workers one at a time. Every child's
output is prefixed with its name. What to run, and in which order, is the plan's; how, is this module's.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import http.client
import itertools
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from zserve.client import Client
from zserve.deploy.plan import ChildSpec, Deployment
from zserve.errors import EXIT_CANNOT_LOAD, BrokerUnavailable
from zserve.frontend_reload import ReloadError, RollingReload
from zserve.state import ProcessState, SupervisorState, write_state
from zserve.transport import child_env

log = logging.getLogger("zserve.deploy.supervisor")

_TICK_S = 0.1
_MAX_BACKOFF_S = 10.0
# Connections that arrive while no server accepts (a master restarting) wait here: a few seconds of a
# busy port's arrivals. Linux caps it at net.core.somaxconn (4096 since 5.4).
LISTEN_BACKLOG = 2048


class StartupError(RuntimeError):
    """The deployment could not start; the message says which process and why."""


@dataclass
class Child:
    """A planned child as it runs: its process and restart history."""

    spec: ChildSpec
    proc: subprocess.Popen | None = None
    restarts: collections.deque = field(default_factory=collections.deque)  # times of recent restarts
    restart_count: int = 0  # since the supervisor started (for `zserve status`)
    started_at: float = 0.0  # wall-clock time of the last start
    restart_at: float | None = None
    pump: threading.Thread | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def role(self) -> str:
        return self.spec.role


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


def lock_run_dir(run_dir: Path) -> IO[str]:
    """Create the run dir (0700, ours) and take its lock, held for as long as the returned file is open: one
    supervisor per run dir, for as long as it lives (a second one would steal the sockets)."""
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    if run_dir.stat().st_uid != os.getuid():
        raise StartupError(f"run dir {run_dir} belongs to another user")
    run_dir.chmod(0o700)
    lock = open(run_dir / "supervisor.lock", "a+")  # held until exit
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        owner = lock.read().strip() or "?"
        lock.close()
        raise StartupError(f"a zserve deployment (pid {owner}) is already running from {run_dir}") from None
    lock.truncate(0)
    lock.write(str(os.getpid()))
    lock.flush()
    for stale in run_dir.glob("*.sock"):
        stale.unlink()
    return lock


def broker_answers(client: Client) -> bool:
    try:
        client.health(timeout_s=0.5)
        return True
    except BrokerUnavailable:
        return False


def workers_registered(client: Client, plan: Deployment) -> bool:
    """Every engine and stage of ``plan`` is in the broker's health report."""
    try:
        report = client.health(timeout_s=1.0)
    except BrokerUnavailable:
        return False
    health = {m.name: m for m in report.models}
    return all(
        m.name in health
        and health[m.name].ready_workers >= m.engines
        and health[m.name].preprocess_workers >= plan.stage_count(m)
        for m in plan.config.models
    )


def wait_for(what: str, ready: Callable[[], bool], timeout_s: float, tick: Callable[[], bool] = lambda: True) -> None:
    """Call ``tick`` until ``ready()`` (a readiness probe) holds; fail on timeout or when ``tick`` says stop."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if not tick():
            raise StartupError(f"stopped while waiting for {what}")
        if time.monotonic() > deadline:
            raise StartupError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(_TICK_S)


class Supervisor:
    """Runs ``plan``: starts its children group by group in start order, each group once the one before is
    ready; restarts what dies; stops everything in stop order."""

    def __init__(self, plan: Deployment, out: IO[str] | None = None) -> None:
        self.plan = plan
        self.config = plan.config
        self.run_dir = plan.run_dir
        self.endpoints = plan.endpoints
        self.url = plan.url
        self.out = out or sys.stdout
        self._out_lock = threading.Lock()
        self.stopping = threading.Event()
        self.gave_up = False
        self.signalled = False  # SIGTERM/SIGINT received: stopping is what was asked for
        self.children: list[Child] = []
        # Our own key for /readyz, which needs one when [frontends] auth_health is set.
        self.probe_key = secrets.token_urlsafe(32)
        self._lock: IO[str] | None = None  # flock on RUN_DIR/supervisor.lock while we own the run dir
        # The frontends' listening socket, bound before the frontend starts and kept open across its
        # restarts, so that a dead master's connections wait in its backlog instead of being refused.
        self.listener: socket.socket | None = None
        self.reload_requested = threading.Event()  # SIGHUP: replace the frontend workers
        self._reload: RollingReload | None = None  # the reload in progress, fed the frontend's output

    # ---- output ----

    def say(self, name: str, line: str) -> None:
        with self._out_lock:
            try:
                self.out.write(f"{name:<16}| {line.rstrip()}\n")
                self.out.flush()
            except (ValueError, OSError):
                pass  # our own output is gone; keep supervising

    def _pump(self, child: Child, stream: IO[bytes]) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace")
            if child.role == "frontend" and (reload := self._reload) is not None:
                reload.on_line(line)
            self.say(child.name, line)
        stream.close()

    # ---- children ----

    def start(self, child: Child) -> None:
        child.restart_at = None
        env = child_env(child.spec.environ(dict(os.environ)))
        if child.role == "frontend":
            env.update(self.plan.frontend_env(self.probe_key))
            metrics_dir = self.plan.metrics_dir  # a fresh one at each start: no dead workers' figures
            shutil.rmtree(metrics_dir, ignore_errors=True)
            metrics_dir.mkdir(mode=0o700)
        child.started_at = time.time()
        child.proc = subprocess.Popen(
            child.spec.argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches only us; we stop children in order
            pass_fds=child.spec.pass_fds,
        )
        child.pump = threading.Thread(target=self._pump, args=(child, child.proc.stdout), daemon=True)
        child.pump.start()
        self.say("supervisor", f"started {child.name} (pid {child.proc.pid})")
        if child not in self.children:
            self.children.append(child)
        self.write_state()

    def write_state(self) -> None:
        """Publish the process table for `zserve status` (RUN_DIR/state.json, replaced atomically)."""
        state = SupervisorState(
            pid=os.getpid(),
            url=self.url,
            staged=list(self.plan.staged),
            processes=[
                ProcessState(
                    name=c.name,
                    role=c.role,
                    pid=c.proc.pid if c.proc is not None else 0,
                    state="restarting" if c.restart_at is not None else "running",
                    started_at=c.started_at,
                    restarts=c.restart_count,
                )
                for c in self.children
            ],
        )
        write_state(self.run_dir, state)

    def tick(self) -> None:
        """Notice dead children; restart them with backoff, or give up."""
        now = time.monotonic()
        s = self.config.supervisor
        for child in self.children:
            if child.proc is None or self.stopping.is_set():
                continue
            if child.restart_at is not None:
                if now >= child.restart_at:
                    self.start(child)
                continue
            code = child.proc.poll()
            if code is None:
                continue
            try:  # whatever the dead child left in its session (a gunicorn worker, a helper) goes with it
                os.killpg(child.proc.pid, child.spec.leftover_signal)
            except (ProcessLookupError, PermissionError):
                pass
            if code == EXIT_CANNOT_LOAD:
                self.say("supervisor", f"ERROR {child.name} cannot load its model (its log above says why): "
                                       "not restarting it, stopping everything")  # fmt: skip
                self.gave_up = True
                self.stopping.set()
                return
            while child.restarts and now - child.restarts[0] > s.restart_window_s:
                child.restarts.popleft()
            if len(child.restarts) >= s.max_restarts:
                self.say(
                    "supervisor",
                    f"ERROR {child.name} exited with code {code} and was restarted "
                    f"{len(child.restarts)} times in {s.restart_window_s:.0f}s: giving up, stopping everything",
                )
                self.gave_up = True
                self.stopping.set()
                return
            backoff = min(_MAX_BACKOFF_S, s.restart_backoff_s * (2 ** len(child.restarts)))
            child.restarts.append(now)
            child.restart_count += 1
            child.restart_at = now + backoff
            self.write_state()
            self.say("supervisor", f"{child.name} exited with code {code}; restarting in {backoff:.1f}s")

    def wait_until(self, what: str, ready: Callable[[], bool]) -> None:
        """Tick until ``ready()`` holds; fail on timeout, stop or give-up."""

        def tick() -> bool:
            if self.stopping.is_set():
                return False
            self.tick()
            return True

        wait_for(what, ready, self.config.supervisor.startup_timeout_s, tick)

    def _http_ready(self) -> bool:
        f = self.config.frontends
        conn = http.client.HTTPConnection(f.host, f.port, timeout=2)
        try:
            conn.request("GET", "/readyz", headers={"Authorization": f"Bearer {self.probe_key}"})
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def _wait_ready(self, readiness: str, client: Callable[[], Client]) -> None:
        """Wait for what ``readiness`` (a ChildSpec's) names to hold for the group just started."""
        if readiness == "broker":
            self.wait_until("the broker", lambda: broker_answers(client()))
        elif readiness == "registered":
            self.wait_until("the engines and stages to register", lambda: workers_registered(client(), self.plan))
        elif readiness == "http":
            self.wait_until(f"{self.url}/readyz", self._http_ready)

    # ---- lifecycle ----

    def prepare_run_dir(self) -> None:
        self._lock = lock_run_dir(self.run_dir)

    def run(self) -> int:
        def on_signal(signum: int, _frame: object) -> None:
            self.signalled = True
            if not self.stopping.is_set():
                self.say("supervisor", f"received {signal.Signals(signum).name}: stopping")
            self.stopping.set()

        specs = self.plan.children()
        serves_http = any(spec.role == "frontend" for spec in specs)
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        if serves_http:
            signal.signal(signal.SIGHUP, lambda _signum, _frame: self.reload_requested.set())
        try:
            self.prepare_run_dir()
            if self.plan.worker_host:
                self.say("supervisor", f"worker host {self.plan.worker_host}: broker at {self.endpoints.work}")
            else:
                self.say("supervisor", f"run dir {self.run_dir}; broker at {self.endpoints.client}")
            with contextlib.ExitStack() as stack:
                clients: list[Client] = []

                def client() -> Client:  # one, opened at first use, for the readiness probes
                    if not clients:
                        clients.append(stack.enter_context(Client(self.endpoints.client)))
                    return clients[0]

                for _, group in itertools.groupby(specs, key=lambda spec: spec.start_order):
                    group = list(group)
                    for spec in group:
                        self.start(Child(self._bound(spec)))
                    self._wait_ready(group[0].ready, client)
            if serves_http:
                self.say("supervisor", f"zserve ready: {self.url}")
                print(f"zserve ready: {self.url}", file=self.out, flush=True)
            self.reload_requested.clear()  # a SIGHUP during start-up: the frontends are new anyway
            while not self.stopping.wait(_TICK_S):
                self.tick()
                if self.reload_requested.is_set():
                    self.reload_requested.clear()
                    self.reload_frontends()
        except StartupError as exc:
            if self.signalled and not self.gave_up:
                self.say("supervisor", f"stopped during start-up ({exc})")  # asked to stop: not a failure
            else:
                self.say("supervisor", f"ERROR {exc}")
                self.gave_up = True
        finally:
            self.shutdown()
        return 1 if self.gave_up else 0

    def _bound(self, spec: ChildSpec) -> ChildSpec:
        """The frontend serves the socket we bind and keep, so that its restarts refuse no connection."""
        if spec.role != "frontend":
            return spec
        f = self.config.frontends
        try:
            self.listener = listen_socket(f.host, f.port)
        except OSError as exc:
            raise StartupError(f"cannot listen on {self.url}: {exc}") from None
        return self.plan.frontend(listen_fd=self.listener.fileno())

    def reload_frontends(self) -> None:
        """SIGHUP: replace the frontend workers with no failed request, one at a time, in a thread
        (``RollingReload``) while ``tick`` goes on."""
        child = next((c for c in self.children if c.role == "frontend"), None)
        if child is None or child.proc is None or child.restart_at is not None or child.proc.poll() is not None:
            self.say("supervisor", "received SIGHUP: no frontend running, nothing to reload")
            return
        if self._reload is not None:
            self.say("supervisor", "received SIGHUP: a frontend reload is already running")
            return
        f = self.config.frontends
        self.say("supervisor", f"received SIGHUP: replacing the {f.workers} frontend workers one at a time")
        # A step is a worker's boot or an old worker's graceful stop (at most graceful_timeout_s).
        self._reload = RollingReload(child.proc.pid, f.workers, step_timeout_s=f.graceful_timeout_s + 60)
        threading.Thread(target=self._run_reload, args=(self._reload,), daemon=True).start()

    def _run_reload(self, reload: RollingReload) -> None:
        at = time.monotonic()
        try:
            replaced = reload.run()
            self.say("supervisor", f"frontend reload done: {replaced} workers replaced in {time.monotonic() - at:.1f}s")
        except ReloadError as exc:
            self.say("supervisor", f"ERROR frontend reload stopped: {exc}")
        finally:
            self._reload = None

    def _stop(self, children: list[Child]) -> None:
        """SIGTERM to ``children`` (one stop group), then SIGKILL to what has not stopped in its time."""
        running = [c for c in children if c.proc is not None and c.proc.poll() is None]
        for child in running:
            try:
                child.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        timeout_s = max((c.spec.stop_timeout_s for c in running), default=0.0)  # one role: one timeout
        deadline = time.monotonic() + timeout_s
        for child in running:
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                what = f"pid {child.proc.pid} ({child.role})"
                self.say("supervisor", f"{what} did not stop in {timeout_s:.0f}s: killing it")
                self._kill_group(child.proc)

    @staticmethod
    def _kill_group(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()

    def shutdown(self) -> None:
        self.stopping.set()
        if self.listener is not None:  # our copy only: gunicorn keeps accepting on its own until it stops
            self.listener.close()
        in_stop_order = sorted(self.children, key=lambda c: c.spec.stop_order)
        for _, group in itertools.groupby(in_stop_order, key=lambda c: c.spec.stop_order):
            self._stop(list(group))
        for child in self.children:
            if child.proc is not None:
                # Anything a child left in its session (a gunicorn worker, a helper) goes too.
                try:
                    os.killpg(child.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            if child.pump is not None:
                child.pump.join(timeout=2)
        if self._lock is not None:  # never remove a run dir that another supervisor owns
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self._lock.close()
        self.say("supervisor", "stopped" + (" (gave up)" if self.gave_up else ""))

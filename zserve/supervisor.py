"""``zserve up``: start, watch and stop every process of a deployment.

Order: broker -> engines -> (once every engine has registered) gunicorn frontends -> one line
``zserve ready: http://HOST:PORT`` once /readyz answers 200. A child that dies is restarted with
exponential backoff; one that dies more than ``max_restarts`` times within ``restart_window_s`` makes
the supervisor give up loudly (stop everything, exit 1) rather than flap. The process table (pids,
start times, restarts) is published in RUN_DIR/state.json for `zserve status`. SIGTERM or Ctrl-C stops in
order (frontends, then the broker, which drains and tells engines to exit, then any straggler) and
exits 0 with nothing left running. Every child's output is prefixed with its name. The frontends are
gunicorn or granian (``[frontends] server``).
"""

from __future__ import annotations

import collections
import fcntl
import http.client
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
from typing import IO

import msgspec

from zserve.client import Client
from zserve.config import (
    Config,
    ConfigError,
    Endpoints,
    FrontendSettings,
    ModelConfig,
    endpoints_for,
    preprocess_workers_for,
    run_dir_for,
)
from zserve.errors import EXIT_CANNOT_LOAD, BrokerUnavailable
from zserve.frontends.reload import ReloadError, RollingReload
from zserve.frontends.servers import listen_socket, server_argv
from zserve.hooks import HookError, check_preprocess_hooks
from zserve.model import load_handler, reports_cost, uses_preprocess
from zserve.state import ProcessState, SupervisorState, write_state

log = logging.getLogger("zserve.supervisor")

_TICK_S = 0.1
_MAX_BACKOFF_S = 10.0


def model_kinds(config: Config) -> tuple[list[str], list[str]]:
    """(staged, generative): the models whose handler overrides ``preprocess`` (they get stage processes),
    and those whose handler is generative (batched per step inside their engines). Loads each handler
    class (constructors only, no weights) and checks its hooks, so that a broken handler fails here, at
    start, with a message that names it."""
    staged, generative = [], []
    for m in config.models:
        try:
            handler = load_handler(m.handler, m.options)
            check_preprocess_hooks(type(handler))
        except (ValueError, HookError) as exc:
            raise ConfigError(f"models[{m.name}]: {exc}") from None
        if m.max_batch_cost and (handler.generative or not reports_cost(type(handler))):
            why = "is generative (batched per step)" if handler.generative else "has no cost() method"
            raise ConfigError(f"models[{m.name}]: max_batch_cost is set but handler {m.handler} {why}")
        if uses_preprocess(type(handler)):
            staged.append(m.name)
        if handler.generative:
            generative.append(m.name)
    return staged, generative


class StartupError(RuntimeError):
    """The deployment could not start; the message says which process and why."""


CHILD_ENV = {"ZSERVE_SUPERVISED": "1", "PYTHONUNBUFFERED": "1"}


@dataclass
class Child:
    name: str
    role: str  # broker | engine | stage | frontend
    argv: list[str]
    extra_env: dict[str, str]  # what this child needs on top of the supervisor's environment
    proc: subprocess.Popen | None = None
    restarts: collections.deque = field(default_factory=collections.deque)  # times of recent restarts
    restart_count: int = 0  # since the supervisor started (for `zserve status`)
    started_at: float = 0.0  # wall-clock time of the last start
    restart_at: float | None = None
    pump: threading.Thread | None = None
    pass_fds: tuple[int, ...] = ()  # the frontend's listening socket, which the supervisor owns

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, **CHILD_ENV, **self.extra_env}


class Supervisor:
    def __init__(self, config: Config, config_path: str | os.PathLike[str], out: IO[str] | None = None) -> None:
        self.config = config
        self.run_dir = run_dir_for(config, config_path)
        self.endpoints: Endpoints = endpoints_for(config, self.run_dir)
        self.out = out or sys.stdout
        self._out_lock = threading.Lock()
        self.stopping = threading.Event()
        self.gave_up = False
        self.signalled = False  # SIGTERM/SIGINT received: stopping is what was asked for
        self.staged, self.generative = model_kinds(config)  # raises ConfigError
        self.children: list[Child] = []
        self.worker_argv_extra: list[str] = []  # a worker host's CURVE key arguments (zserve.worker_host)
        # Our own key for /readyz, which needs one when [frontends] auth_health is set.
        self.probe_key = secrets.token_urlsafe(32)
        self._lock: IO[str] | None = None  # flock on RUN_DIR/supervisor.lock while we own the run dir
        # The frontends' listening socket, bound by run() and kept open across frontend restarts, so that a
        # dead master's connections wait in its backlog instead of being refused.
        self.listener: socket.socket | None = None
        self.reload_requested = threading.Event()  # SIGHUP: replace the frontend workers
        self._reload: RollingReload | None = None  # the reload in progress, fed the frontend's output
        f = config.frontends
        host = f"[{f.host}]" if ":" in f.host else f.host
        self.url = f"http://{host}:{f.port}"

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

    def broker_child(self) -> Child:
        e = self.endpoints
        config_json = msgspec.json.encode(self.config).decode()
        argv = [sys.executable, "-m", "zserve.broker.broker", "--config-json", config_json,
                "--client", e.client, "--work", e.work, "--out", e.out,
                "--staged-models", ",".join(self.staged),
                "--generative-models", ",".join(self.generative)]  # fmt: skip
        return Child("broker", "broker", argv, {})

    def engine_child(self, model: ModelConfig, index: int) -> Child:
        env = {"OMP_NUM_THREADS": str(model.threads)}  # torch's intra-op threads (the engine sets the rest)
        device = model.device_for(index)
        if device.startswith("cuda:"):  # "cuda:2" or, for a tensor parallel group, "cuda:2,3" (rank r: cuda:r)
            env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
            device = "cuda:0"
        name = f"engine-{model.name}-{index}"
        return Child(name, "engine", self._worker_argv("engine", name, model, device), env)

    def stage_child(self, model: ModelConfig, index: int) -> Child:
        """A preprocess stage: CPU only (no device), one credit, so batches spread evenly over stages."""
        env = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": str(model.threads)}  # a stage never uses a device
        name = f"stage-{model.name}-{index}"
        return Child(name, "stage", [*self._worker_argv("preprocess", name, model, "cpu"), "--credits", "1"], env)

    def _worker_argv(self, module: str, name: str, model: ModelConfig, device: str) -> list[str]:
        b = self.config.broker
        return [sys.executable, "-m", f"zserve.stages.{module}", "--name", name,
                "--model-json", msgspec.json.encode(model).decode(), "--device", device,
                "--work-endpoint", self.endpoints.work, "--out-endpoint", self.endpoints.out,
                "--heartbeat-interval-ms", str(b.heartbeat_interval_ms),
                "--heartbeat-liveness", str(b.heartbeat_liveness), *self.worker_argv_extra]  # fmt: skip

    def worker_children(self) -> list[Child]:
        """Every engine and stage process of the deployment, model by model."""
        children = []
        for model in self.config.models:
            children += [self.engine_child(model, i) for i in range(model.engines)]
            children += [self.stage_child(model, i) for i in range(self.stage_count(model))]
        return children

    def stage_count(self, model: ModelConfig) -> int:
        return preprocess_workers_for(self.config, model, self.staged) if model.name in self.staged else 0

    def frontend_child(self) -> Child:
        """The HTTP server ([frontends] server); its environment is built by ``frontend_env`` when it
        starts (a fresh metrics dir each time). gunicorn serves the supervisor's socket once run() has bound it."""
        f = self.config.frontends
        fd = self.listener.fileno() if self.listener is not None and f.server == "gunicorn" else None
        argv = server_argv(f, self.run_dir / f"{f.server}-{f.port}.pid", fd)  # one run dir may serve several ports
        return Child("frontend", "frontend", argv, {}, pass_fds=(fd,) if fd is not None else ())

    def frontend_env(self) -> dict[str, str]:
        """What every frontend worker reads: its settings (JSON) and an empty prometheus multiprocess dir."""
        metrics_dir = self.run_dir / f"metrics-{self.config.frontends.port}"  # one per frontend server
        shutil.rmtree(metrics_dir, ignore_errors=True)
        metrics_dir.mkdir(mode=0o700)
        settings = FrontendSettings.from_config(self.config, self.endpoints, self.staged, probe_key=self.probe_key)
        return {"ZSERVE_FRONTEND": msgspec.json.encode(settings).decode(), "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}

    def start(self, child: Child) -> None:
        child.restart_at = None
        if child.role == "frontend":
            child.extra_env.update(self.frontend_env())
        child.started_at = time.time()
        child.proc = subprocess.Popen(
            child.argv,
            env=child.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches only us; we stop children in order
            pass_fds=child.pass_fds,
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
            staged=self.staged,
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
            try:  # whatever the dead child left in its session (a gunicorn worker, a helper) goes with it; a
                # dead master's workers stop gracefully, answering the requests they hold
                os.killpg(child.proc.pid, signal.SIGTERM if child.role == "frontend" else signal.SIGKILL)
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
        """Tick until ``ready()`` (a readiness probe) holds; fail on timeout, stop or give-up."""
        deadline = time.monotonic() + self.config.supervisor.startup_timeout_s
        while not ready():
            if self.stopping.is_set():
                raise StartupError(f"stopped while waiting for {what}")
            if time.monotonic() > deadline:
                raise StartupError(
                    f"timed out after {self.config.supervisor.startup_timeout_s:.0f}s waiting for {what}"
                )
            self.tick()
            time.sleep(_TICK_S)

    # ---- readiness probes ----

    def engines_registered(self, client: Client) -> bool:
        try:
            report = client.health(timeout_s=1.0)
        except BrokerUnavailable:
            return False
        health = {m.name: m for m in report.models}
        return all(
            m.name in health
            and health[m.name].ready_workers >= m.engines
            and health[m.name].preprocess_workers >= self.stage_count(m)
            for m in self.config.models
        )

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

    # ---- lifecycle ----

    @property
    def lock_fd(self) -> int:
        assert self._lock is not None, "prepare_run_dir() first"
        return self._lock.fileno()

    def prepare_run_dir(self) -> None:
        self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.run_dir.stat().st_uid != os.getuid():
            raise StartupError(f"run dir {self.run_dir} belongs to another user")
        self.run_dir.chmod(0o700)
        # One supervisor per run dir, for as long as it lives: a second one would steal the sockets.
        self._lock = open(self.run_dir / "supervisor.lock", "a+")  # held until exit
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.seek(0)
            owner = self._lock.read().strip() or "?"
            self._lock.close()
            self._lock = None
            raise StartupError(f"a zserve deployment (pid {owner}) is already running from {self.run_dir}") from None
        self._lock.truncate(0)
        self._lock.write(str(os.getpid()))
        self._lock.flush()
        for stale in self.run_dir.glob("*.sock"):
            stale.unlink()

    def run(self) -> int:
        def on_signal(signum: int, _frame: object) -> None:
            self.signalled = True
            if not self.stopping.is_set():
                self.say("supervisor", f"received {signal.Signals(signum).name}: stopping")
            self.stopping.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGHUP, lambda _signum, _frame: self.reload_requested.set())
        try:
            self.prepare_run_dir()
            self.say("supervisor", f"run dir {self.run_dir}; broker at {self.endpoints.client}")
            self.start(self.broker_child())
            with Client(self.endpoints.client) as client:
                self.wait_until("the broker", lambda: self._broker_answers(client))
                for child in self.worker_children():
                    self.start(child)
                self.wait_until("the engines and stages to register", lambda: self.engines_registered(client))
            self.bind_listener()
            self.start(self.frontend_child())
            self.wait_until(f"{self.url}/readyz", self._http_ready)
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

    def bind_listener(self) -> None:
        f = self.config.frontends
        if f.server != "gunicorn":
            return  # granian cannot serve an inherited socket: it binds host:port itself
        try:
            self.listener = listen_socket(f.host, f.port)
        except OSError as exc:
            raise StartupError(f"cannot listen on {self.url}: {exc}") from None

    def reload_frontends(self) -> None:
        """SIGHUP: replace the frontend workers with no failed request. gunicorn: one at a time, in a thread
        (``RollingReload``) while ``tick`` goes on; granian: its own SIGHUP reload (it respawns each worker,
        then stops the old one)."""
        child = next((c for c in self.children if c.role == "frontend"), None)
        if child is None or child.proc is None or child.restart_at is not None or child.proc.poll() is not None:
            self.say("supervisor", "received SIGHUP: no frontend running, nothing to reload")
            return
        if self.config.frontends.server == "granian":
            self.say("supervisor", f"received SIGHUP: reloading {child.name} (granian respawns its workers)")
            child.proc.send_signal(signal.SIGHUP)
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

    @staticmethod
    def _broker_answers(client: Client) -> bool:
        try:
            client.health(timeout_s=0.5)
            return True
        except BrokerUnavailable:
            return False

    def _stop(self, role: str, sig: int, timeout_s: float) -> None:
        procs = [c.proc for c in self.children if c.role == role and c.proc is not None and c.proc.poll() is None]
        for proc in procs:
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say("supervisor", f"pid {proc.pid} ({role}) did not stop in {timeout_s:.0f}s: killing it")
                self._kill_group(proc)

    @staticmethod
    def _kill_group(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()

    def shutdown(self) -> None:
        self.stopping.set()
        c = self.config
        if self.listener is not None:  # our copy only: gunicorn keeps accepting on its own until it stops
            self.listener.close()
        self._stop("frontend", signal.SIGTERM, c.frontends.graceful_timeout_s + 5)
        self._stop("broker", signal.SIGTERM, c.broker.drain_timeout_s + 5)
        self._stop("engine", signal.SIGTERM, c.supervisor.shutdown_timeout_s)
        self._stop("stage", signal.SIGTERM, c.supervisor.shutdown_timeout_s)
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

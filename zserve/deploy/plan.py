"""The deployment plan: from a config, the processes to run (name, role, command line, environment, what
"ready" means for each, start and stop order, stop timeouts), as data. Nothing here starts, signals or waits
for a process: `zserve up` and `zserve workers` run a plan (``zserve.deploy.supervisor``), `zserve supervisord-conf`
and `zserve child` render and exec it (``zserve.deploy.supervisord``), `zserve k8s` turns it into manifests
(``zserve.deploy.k8s``), and ``zserve.serve`` runs `zserve up`.

The children refer to the modules they run by name (``-m zserve.broker.broker``, ``-m gunicorn``): the plan
imports none of the rooms above the base package (broker, stages, frontends).
"""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import msgspec

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
from zserve.hooks import HookError, check_preprocess_hooks
from zserve.model import load_handler, reports_cost, uses_preprocess

Role = Literal["broker", "engine", "stage", "frontend"]
# What must hold before the next start group starts: the broker answers a health request; the worker is in
# the broker's health report; /readyz answers 200; "" nothing this host can check (a worker host's workers
# join a broker elsewhere, which may not be up yet: they keep trying).
Readiness = Literal["broker", "registered", "http", ""]

CHILD_ENV = {"ZSERVE_SUPERVISED": "1", "PYTHONUNBUFFERED": "1"}  # every supervised child's, on top of its own

# gunicorn's asgi worker with zserve's fast predict path, serving the falcon app
FRONTEND_FACTORY = "zserve.frontends.app:create_frontend"
WORKER_CLASS = "zserve.frontends.fast_worker.FastPathWorker"

# Start order (lower first). Stop order is not its reverse: the broker stops before the workers, because it
# drains (answers what it holds) and then tells its workers to exit.
START_ORDER: dict[str, int] = {"broker": 0, "stage": 1, "engine": 1, "frontend": 2}
STOP_ORDER: dict[str, int] = {"frontend": 0, "broker": 1, "engine": 2, "stage": 3}


@dataclass(frozen=True)
class ChildSpec:
    """One process of the plan."""

    name: str
    role: Role
    argv: tuple[str, ...]
    env: dict[str, str]  # on top of the runner's environment and CHILD_ENV
    ready: Readiness
    start_order: int
    stop_order: int
    stop_timeout_s: float  # after SIGTERM, before SIGKILL: what this role needs to stop gracefully
    # What the rest of a dead child's process group gets: a dead gunicorn master's workers stop gracefully,
    # answering the requests they hold; anything else a dead child left is killed.
    leftover_signal: signal.Signals = signal.SIGKILL
    pass_fds: tuple[int, ...] = ()  # the frontend's listening socket, when the runner owns it

    def environ(self, base: dict[str, str]) -> dict[str, str]:
        """The child's whole environment, on top of ``base`` (the runner's)."""
        return {**base, **CHILD_ENV, **self.env}


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


def stop_timeout_s(config: Config, role: Role) -> float:
    """How long a child of ``role`` may take to stop after SIGTERM."""
    if role == "frontend":
        return config.frontends.graceful_timeout_s + 5
    if role == "broker":
        return config.broker.drain_timeout_s + 5
    return config.supervisor.shutdown_timeout_s


@dataclass(frozen=True)
class Deployment:
    """What one config deploys. Build it with ``plan``; every method is a pure function of it."""

    config: Config
    run_dir: Path
    endpoints: Endpoints
    staged: tuple[str, ...]  # models with a preprocess stage
    generative: tuple[str, ...]
    worker_args: tuple[str, ...] = ()  # extra worker arguments: CURVE keys for a broker on another host
    # "": the whole deployment on this host. A host name: only this worker host's engines and stages, named
    # NAME@HOST, so that the broker's logs say which host a worker is on and its hung-worker check (by name in
    # /proc) never takes a process of its own host for one of ours.
    worker_host: str = ""

    @property
    def address(self) -> str:
        """The frontends' host:port (an IPv6 host in brackets)."""
        f = self.config.frontends
        host = f"[{f.host}]" if ":" in f.host else f.host
        return f"{host}:{f.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def children(self) -> list[ChildSpec]:
        """Every process, in start order (the frontend binds host:port itself; see ``frontend``)."""
        if self.worker_host:
            return self.workers()
        return [self.broker(), *self.workers(), self.frontend()]

    def _spec(self, name: str, role: Role, argv: list[str], env: dict[str, str], ready: Readiness) -> ChildSpec:
        return ChildSpec(
            name=name,
            role=role,
            argv=tuple(argv),
            env=env,
            ready=ready,
            start_order=START_ORDER[role],
            stop_order=STOP_ORDER[role],
            stop_timeout_s=stop_timeout_s(self.config, role),
        )

    def broker(self) -> ChildSpec:
        e, config_json = self.endpoints, msgspec.json.encode(self.config).decode()
        argv = [sys.executable, "-m", "zserve.broker.broker", "--config-json", config_json,
                "--client", e.client, "--work", e.work, "--out", e.out,
                "--staged-models", ",".join(self.staged),
                "--generative-models", ",".join(self.generative)]  # fmt: skip
        return self._spec("broker", "broker", argv, {}, "broker")

    def engine(self, model: ModelConfig, index: int) -> ChildSpec:
        env = {"OMP_NUM_THREADS": str(model.threads)}  # torch's intra-op threads (the engine sets the rest)
        device = model.device_for(index)
        if device.startswith("cuda:"):  # "cuda:2" or, for a tensor parallel group, "cuda:2,3" (rank r: cuda:r)
            env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
            device = "cuda:0"
        name = self._worker_name(f"engine-{model.name}-{index}")
        return self._spec(name, "engine", self._worker_argv("engine", name, model, device), env, self._worker_ready)

    def stage(self, model: ModelConfig, index: int) -> ChildSpec:
        """A preprocess stage: CPU only (no device), one credit, so batches spread evenly over stages."""
        env = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": str(model.threads)}  # a stage never uses a device
        name = self._worker_name(f"stage-{model.name}-{index}")
        argv = [*self._worker_argv("preprocess", name, model, "cpu"), "--credits", "1"]
        return self._spec(name, "stage", argv, env, self._worker_ready)

    @property
    def _worker_ready(self) -> Readiness:
        return "" if self.worker_host else "registered"

    def _worker_name(self, name: str) -> str:
        return f"{name}@{self.worker_host}" if self.worker_host else name

    def _worker_argv(self, module: str, name: str, model: ModelConfig, device: str) -> list[str]:
        b = self.config.broker
        return [sys.executable, "-m", f"zserve.workers.{module}", "--name", name,
                "--model-json", msgspec.json.encode(model).decode(), "--device", device,
                "--work-endpoint", self.endpoints.work, "--out-endpoint", self.endpoints.out,
                "--heartbeat-interval-ms", str(b.heartbeat_interval_ms),
                "--heartbeat-liveness", str(b.heartbeat_liveness),
                "--priority-aging-ms", repr(b.priority_aging_ms), *self.worker_args]  # fmt: skip

    def workers(self) -> list[ChildSpec]:
        """Every engine and stage process, model by model."""
        children = []
        for model in self.config.models:
            children += [self.engine(model, i) for i in range(model.engines)]
            children += [self.stage(model, i) for i in range(self.stage_count(model))]
        return children

    def stage_count(self, model: ModelConfig) -> int:
        staged = list(self.staged)
        return preprocess_workers_for(self.config, model, staged) if model.name in staged else 0

    def frontend(self, listen_fd: int | None = None) -> ChildSpec:
        """The HTTP server: gunicorn serving ``listen_fd`` (a listening socket the runner owns and passes, so
        that a master that dies and restarts refuses no connection: they wait in the backlog), or binding
        host:port itself. Its settings come from ``frontend_env`` when it starts."""
        f = self.config.frontends
        bind = f"fd://{listen_fd}" if listen_fd is not None else self.address
        pid_file = self.run_dir / f"gunicorn-{f.port}.pid"  # one run dir may serve several ports
        argv = [sys.executable, "-m", "gunicorn", "--worker-class", WORKER_CLASS, "--workers", str(f.workers),
                "--bind", bind, "--no-control-socket", "--http-parser", "fast",
                "--graceful-timeout", str(int(f.graceful_timeout_s)),
                "--asgi-disconnect-grace-period", "0", "--keep-alive", str(f.keep_alive_s + 1),
                "--worker-connections", str(f.max_connections), "--error-logfile", "-",
                "--pid", str(pid_file), "-c", "python:zserve.frontends.gunicorn_conf",
                f"{FRONTEND_FACTORY}()"]  # fmt: skip
        spec = self._spec("frontend", "frontend", argv, {}, "http")
        fds = (listen_fd,) if listen_fd is not None else ()
        return replace(spec, leftover_signal=signal.SIGTERM, pass_fds=fds)

    @property
    def metrics_dir(self) -> Path:
        """The frontend workers' prometheus multiprocess dir, one per frontend server; emptied at each start."""
        return self.run_dir / f"metrics-{self.config.frontends.port}"

    def frontend_settings(self, probe_key: str = "") -> FrontendSettings:
        return FrontendSettings.from_config(self.config, self.endpoints, list(self.staged), probe_key=probe_key)

    def frontend_env(self, probe_key: str) -> dict[str, str]:
        """What every frontend worker reads: its settings (JSON) and its metrics dir. Given when the frontend
        starts, not in the plan: the settings carry the runner's probe key, which no rendered file holds."""
        settings = msgspec.json.encode(self.frontend_settings(probe_key)).decode()
        return {"ZSERVE_FRONTEND": settings, "PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir)}

    def child(self, name: str) -> ChildSpec:
        """The process called ``name``: broker, frontend, engine-MODEL-I or stage-MODEL-I (any I, so that a
        stage count that changed since a file was rendered is still served)."""
        if name == "broker":
            return self.broker()
        if name == "frontend":
            return self.frontend()
        role, _, rest = name.partition("-")
        model_name, _, index = rest.rpartition("-")
        known = {m.name for m in self.config.models}
        if role not in ("engine", "stage") or not index.isdigit() or model_name not in known:
            raise ConfigError(f"no process named {name!r} in this deployment")
        model = self.config.model(model_name)
        return self.engine(model, int(index)) if role == "engine" else self.stage(model, int(index))


def plan(config: Config, config_path: str | Path) -> Deployment:
    """The deployment ``config`` describes, run from ``config_path`` (which names its run dir unless the config
    does). Imports every handler class (constructors only) to learn which models have stages or generate, so a
    broken handler fails here with a ConfigError that names it."""
    run_dir = run_dir_for(config, config_path)
    staged, generative = model_kinds(config)
    return Deployment(config, run_dir, endpoints_for(config, run_dir), tuple(staged), tuple(generative))

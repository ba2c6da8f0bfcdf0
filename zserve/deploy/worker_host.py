"""``zserve workers -c workers.toml``: a worker host. It runs only the engines and stages of its
[[models]] tables, connected to a broker on another host over tcp (CURVE unless ``insecure``): a plan
(``worker_host_plan``) that the supervisor of ``zserve up`` runs (restarts with backoff, giving up
loudly). The broker treats them like its own workers: credits, heartbeats, re-dispatch of what a lost
worker held. A worker whose link drops hears no broker heartbeat for the liveness period, registers again,
and is served again once the link is back (ZeroMQ reconnects by itself)."""

from __future__ import annotations

import os
import socket
from dataclasses import replace
from pathlib import Path

import msgspec

from zserve.config import (
    AgingMs,
    BrokerConfig,
    Config,
    ConfigError,
    Endpoints,
    ModelConfig,
    PositiveInt,
    SupervisorConfig,
    _Section,
    check_tcp_endpoint,
    load_toml,
)
from zserve.deploy.plan import Deployment, plan
from zserve.devices import check_devices


class RemoteBrokerConfig(_Section, kw_only=True):
    """Where the broker listens for workers of other hosts, and how this host authenticates."""

    work_endpoint: str  # the broker's [broker] work_endpoint, tcp://HOST:PORT
    out_endpoint: str  # its [broker] out_endpoint
    curve_key: str = ""  # this host's NAME.key_secret (its NAME.key is in the broker's authorized_keys_dir)
    broker_key: str = ""  # the broker's public NAME.key
    insecure: bool = False  # plain tcp (the broker must say insecure = true as well)
    heartbeat_interval_ms: PositiveInt = 250  # as the broker's
    heartbeat_liveness: PositiveInt = 4
    priority_aging_ms: AgingMs = 1000.0  # as the broker's: engines age queued sequences alike

    def __post_init__(self) -> None:
        for key in ("work_endpoint", "out_endpoint"):
            endpoint = getattr(self, key)
            if not endpoint:
                raise ValueError(f"broker.{key} is required: the remote broker's tcp://HOST:PORT")
            check_tcp_endpoint(f"broker.{key}", endpoint, False, True)
        if not self.insecure and (not self.curve_key or not self.broker_key):
            raise ValueError("curve_key and broker_key are required (CURVE), or insecure = true")


class WorkersConfig(_Section, kw_only=True):
    host_name: str = ""  # "" = this machine's host name; part of every worker's name, as the broker logs it
    supervisor: SupervisorConfig = msgspec.field(default_factory=SupervisorConfig)
    broker: RemoteBrokerConfig
    models: list[ModelConfig] = []

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("at least one [[models]] table is required")


def load_workers_config(path: str | os.PathLike[str]) -> WorkersConfig:
    return load_toml(path, WorkersConfig)


def worker_host_plan(workers: WorkersConfig, config_path: str | os.PathLike[str]) -> Deployment:
    """The plan of ``zserve up`` reduced to the engines and stages of ``workers``' models, named NAME@HOST and
    pointed at the remote broker (with this host's CURVE keys unless insecure). Run it with a Supervisor."""
    r = workers.broker
    config = Config(
        supervisor=workers.supervisor,
        broker=BrokerConfig(
            heartbeat_interval_ms=r.heartbeat_interval_ms,
            heartbeat_liveness=r.heartbeat_liveness,
            priority_aging_ms=r.priority_aging_ms,
        ),
        models=workers.models,
    )
    check_devices(workers.models)
    worker_args: tuple[str, ...] = ()
    if not r.insecure:
        for path in (r.curve_key, r.broker_key):
            if not Path(path).is_file():
                raise ConfigError(f"{config_path}: broker: key file {path} does not exist")
        key, broker_key = (str(Path(p).expanduser().resolve()) for p in (r.curve_key, r.broker_key))
        worker_args = ("--curve-key", key, "--broker-key", broker_key)
    return replace(
        plan(config, config_path),
        endpoints=Endpoints(client="", work=r.work_endpoint, out=r.out_endpoint),
        worker_args=worker_args,
        worker_host=workers.host_name or socket.gethostname(),
    )

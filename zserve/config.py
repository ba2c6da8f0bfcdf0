"""supervisor.toml, decoded into typed Structs. Unknown keys and bad values are rejected by key name.

Every key is documented in README.md ("Configuration reference"); keep the two in step.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

PositiveInt = Annotated[int, Meta(ge=1)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
NonNegativeFloat = Annotated[float, Meta(ge=0)]
PositiveFloat = Annotated[float, Meta(gt=0)]

_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_HANDLER = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
# sun_path in sockaddr_un holds 108 bytes, NUL included.
_MAX_IPC_PATH = 107


class ConfigError(ValueError):
    """supervisor.toml is unreadable or invalid; the message names the key."""


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class SupervisorConfig(_Section, kw_only=True):
    run_dir: str = ""  # "" = a private directory derived from the config file's path (see run_dir_for)
    max_restarts: NonNegativeInt = 5  # per process, within restart_window_s; then give up loudly
    restart_window_s: PositiveFloat = 60.0
    restart_backoff_s: NonNegativeFloat = 0.5  # doubles with each restart in the window, capped at 10 s
    startup_timeout_s: PositiveFloat = 600.0
    shutdown_timeout_s: PositiveFloat = 20.0


class BrokerConfig(_Section, kw_only=True):
    # Processes of this host always use ipc://RUN_DIR/{client,work,out}.sock; a tcp://HOST:PORT here is
    # bound as well, for direct clients (client) and worker hosts (work, out) elsewhere.
    client_endpoint: str = ""
    work_endpoint: str = ""
    out_endpoint: str = ""
    curve_key: str = ""  # the broker's NAME.key_secret; required with a tcp endpoint unless insecure
    authorized_keys_dir: str = ""  # the NAME.key (public) of every client and worker host admitted over tcp
    insecure: bool = False  # tcp without CURVE: anyone who reaches the port is served; loopback only...
    insecure_any_host: bool = False  # ...unless this is set too
    heartbeat_interval_ms: PositiveInt = 250
    heartbeat_liveness: PositiveInt = 4  # missed intervals before a worker (or the broker) is declared lost
    max_redispatch: NonNegativeInt = 1  # re-dispatches of a lost batch before ENGINE_LOST
    drain_timeout_s: NonNegativeFloat = 10.0

    def __post_init__(self) -> None:
        for key in ("client_endpoint", "work_endpoint", "out_endpoint"):
            check_tcp_endpoint(f"broker.{key}", getattr(self, key), self.insecure, self.insecure_any_host)
        if any(e.startswith("tcp://") for e in self.remote_endpoints()) and not self.insecure:
            if not self.curve_key or not self.authorized_keys_dir:
                raise ValueError(
                    "a tcp:// endpoint needs curve_key and authorized_keys_dir (CURVE; see `zserve keys "
                    "generate`), or insecure = true"
                )

    def remote_endpoints(self) -> tuple[str, str, str]:
        return self.client_endpoint, self.work_endpoint, self.out_endpoint


_LOOPBACK = ("127.0.0.1", "::1", "[::1]", "localhost")


def check_tcp_endpoint(key: str, endpoint: str, insecure: bool, any_host: bool) -> None:
    """``endpoint`` is "" or tcp://HOST:PORT; plain (insecure) tcp only on loopback unless ``any_host``."""
    if not endpoint:
        return
    match = re.match(r"^tcp://(\[[0-9a-fA-F:.]+\]|[^:/\[\]]+):(\d{1,5})$", endpoint)
    if not match or not 0 < int(match.group(2)) < 65536:
        raise ValueError(f"{key} = {endpoint!r} must look like tcp://HOST:PORT (ipc is always there)")
    if insecure and not any_host and match.group(1) not in _LOOPBACK:
        raise ValueError(
            f"{key} = {endpoint!r}: insecure (plain) tcp binds to loopback only; set insecure_any_host = true "
            "to expose it, or use CURVE"
        )


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, as a container's cpuset sets it), not the host's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class FrontendsConfig(_Section, kw_only=True):
    # HTTP worker processes; 0 = half the CPU cores, at least 1: the other half runs the broker, stages and
    # engines. On this 2-core VM one worker answered echo at c64 over HTTP 1.15x faster than two, p99 2.6 ms
    # against 4.6 (README, issue 9): wrk, the broker and the engine need the other core.
    workers: NonNegativeInt = 0
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=1, le=65535)] = 8000
    max_body_bytes: PositiveInt = 1 << 20
    graceful_timeout_s: NonNegativeFloat = 10.0
    server: Literal["gunicorn", "granian"] = "gunicorn"  # the HTTP server that runs the falcon ASGI app
    api_keys_file: str = ""  # "" = no key file; keys may also come from ZSERVE_API_KEYS
    auth_health: bool = False  # true: /healthz, /readyz and /metrics need a key too

    def __post_init__(self) -> None:
        if self.workers == 0:
            self.workers = max(1, usable_cores() // 2)


class ModelConfig(_Section, kw_only=True):
    name: str
    handler: str  # "module:Class", a zserve.Model subclass
    engines: PositiveInt = 1
    max_batch_size: PositiveInt = 32
    max_wait_ms: NonNegativeFloat = 5.0
    # Cost-aware batching: 0 = batches by count only. Otherwise a batch costs its size times its largest
    # item's cost (what a padded batch computes; an item's cost is what the handler's ``cost(item)`` says,
    # tokens for the text handlers) and is closed before it would pass this budget; items of similar cost
    # are grouped (see broker/scheduler.py for the fairness bound).
    max_batch_cost: NonNegativeInt = 0
    max_queue: PositiveInt = 1024
    timeout_ms: PositiveInt = 30_000
    credits: PositiveInt = 2  # batches an engine may hold at once (2 = one running, one staged)
    # A worker holding work that makes no progress (no result, no engine step) for this long is hung: its
    # batches are re-dispatched and it is killed (the supervisor restarts it). None = derived: the larger
    # of timeout_ms and 10x the slowest recent batch of the model (see README).
    batch_timeout_s: PositiveFloat | None = None
    threads: PositiveInt = 1  # torch intra-op threads per engine
    # "cuda:N", "cuda:N,M,..." (one engine on several devices: a tensor parallel group) or "cpu"; engine i gets
    # devices[i % len]; [] = "cpu"
    devices: list[str] = []
    engines_per_device: PositiveInt | None = None  # set: engines = len(devices) x this, each device alike
    options: dict[str, Any] = {}  # passed to the handler's constructor
    preprocess_workers: Annotated[int, Meta(ge=1)] | None = None  # None = see preprocess_workers_for

    def __post_init__(self) -> None:
        if not _MODEL_NAME.match(self.name):
            raise ValueError(f"name {self.name!r} must match {_MODEL_NAME.pattern}")
        if not _HANDLER.match(self.handler):
            raise ValueError(f"handler {self.handler!r} must look like 'package.module:Class'")
        bad = [d for d in self.devices if d != "cpu" and not re.match(r"^cuda:\d+(,\d+)*$", d)]
        if bad:
            raise ValueError(
                f"devices {bad} must each be 'cuda:N' or 'cpu', or 'cuda:N,M,...' for an engine on several devices"
            )
        if self.engines_per_device is not None:
            if not self.devices:
                raise ValueError("engines_per_device needs devices = [...]")
            count = len(self.devices) * self.engines_per_device
            if self.engines not in (1, count):
                raise ValueError(
                    f"engines = {self.engines} contradicts {len(self.devices)} devices x engines_per_device"
                )
            self.engines = count

    def device_for(self, engine_index: int) -> str:
        return self.devices[engine_index % len(self.devices)] if self.devices else "cpu"


class Config(_Section, kw_only=True):
    supervisor: SupervisorConfig = msgspec.field(default_factory=SupervisorConfig)
    broker: BrokerConfig = msgspec.field(default_factory=BrokerConfig)
    frontends: FrontendsConfig = msgspec.field(default_factory=FrontendsConfig)
    models: list[ModelConfig] = []

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("at least one [[models]] table is required")
        names = [m.name for m in self.models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"model names must be unique: {', '.join(dupes)}")

    def model(self, name: str) -> ModelConfig:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)


def preprocess_workers_for(config: Config, model: ModelConfig, staged: list[str], cores: int | None = None) -> int:
    """Stage processes for a model with a ``preprocess`` hook: ``preprocess_workers`` if set, else the cores
    the engines leave free (cores - sum of engines x threads over all models), shared evenly among the
    models with a stage, at least 1 each."""
    if model.preprocess_workers is not None:
        return model.preprocess_workers
    cores = cores or os.cpu_count() or 1
    engine_cores = sum(m.engines * m.threads for m in config.models)
    return max(1, (cores - engine_cores) // max(1, len(staged)))


class Endpoints(msgspec.Struct, frozen=True):
    """Where the broker binds; decided once (by the supervisor) and passed to every child."""

    client: str
    work: str
    out: str


def _readable(exc: msgspec.ValidationError) -> str:
    # msgspec says "... - at `$.models[0].max_batch_size`"; name the key the way the file spells it.
    text = str(exc)
    match = re.search(r" - at `\$\.?(.*)`$", text)
    if match:
        return f"{match.group(1) or '(top level)'}: {text[: match.start()]}"
    return text


def parse_config(data: bytes | str, source: str = "supervisor.toml") -> Config:
    try:
        return msgspec.toml.decode(data, type=Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {_readable(exc)}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None


def load_config(path: str | os.PathLike[str]) -> Config:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    return parse_config(data, str(path))


def run_dir_for(config: Config, config_path: str | os.PathLike[str]) -> Path:
    """The private run directory for ipc sockets: configured, or derived from the config file's path,
    so that a client given the same file finds the same broker."""
    if config.supervisor.run_dir:
        return Path(config.supervisor.run_dir).expanduser().resolve()
    digest = hashlib.sha1(str(Path(config_path).resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"zserve-{os.getuid()}-{digest}"


def endpoints_for(config: Config, run_dir: Path) -> Endpoints:
    """The ipc endpoints every process of this host uses; [broker]'s tcp endpoints are bound beside them."""

    def ipc(name: str) -> str:
        address = f"ipc://{run_dir / name}"
        if len(address) - len("ipc://") > _MAX_IPC_PATH:
            raise ConfigError(f"supervisor.run_dir: {run_dir} is too long for an ipc socket path; choose a shorter one")
        return address

    return Endpoints(client=ipc("client.sock"), work=ipc("work.sock"), out=ipc("out.sock"))


class ServedModel(msgspec.Struct, kw_only=True):
    """What a frontend needs to know of one model (it never loads weights)."""

    name: str
    handler: str
    options: dict[str, Any] = {}
    timeout_ms: int = 30_000
    preprocess: bool = False  # has a preprocess stage: /readyz also waits for one
    max_batch_cost: int = 0  # > 0: the frontends report each item's cost (``Model.cost``) with its Submit


class FrontendSettings(msgspec.Struct, kw_only=True):
    """Handed by the supervisor to each gunicorn worker (env ZSERVE_FRONTEND, as JSON)."""

    client_endpoint: str
    models: list[ServedModel]
    max_body_bytes: int = 1 << 20
    api_keys_file: str = ""  # absolute (resolved where `zserve up` runs)
    auth_health: bool = False
    probe_key: str = ""  # the supervisor's own key, accepted on the health routes only (its /readyz polls)

    @classmethod
    def from_config(
        cls, config: Config, endpoints: Endpoints, staged: list[str], probe_key: str = ""
    ) -> FrontendSettings:
        f = config.frontends
        return cls(
            client_endpoint=endpoints.client,
            models=[
                ServedModel(
                    name=m.name,
                    handler=m.handler,
                    options=m.options,
                    timeout_ms=m.timeout_ms,
                    preprocess=m.name in staged,
                    max_batch_cost=m.max_batch_cost,
                )
                for m in config.models
            ],
            max_body_bytes=config.frontends.max_body_bytes,
            api_keys_file=str(Path(f.api_keys_file).expanduser().resolve()) if f.api_keys_file else "",
            auth_health=f.auth_health,
            probe_key=probe_key,
        )


def _toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)  # strings, numbers and booleans are spelled alike in JSON and TOML


def to_toml(config: Config) -> str:
    """``config`` as a supervisor.toml that ``load_config`` reads back to the same Config."""
    data = msgspec.to_builtins(config)
    lines: list[str] = []
    for section in ("supervisor", "broker", "frontends"):
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in data[section].items()]
        lines.append("")
    for model in data["models"]:
        options = model.pop("options", {})
        lines.append("[[models]]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in model.items() if value is not None]
        if options:
            lines.append("[models.options]")
            lines += [f"{key} = {_toml_value(value)}" for key, value in options.items()]
        lines.append("")
    text = "\n".join(lines)
    parse_config(text, "generated supervisor.toml")  # fail here, not in `zserve up`, if it does not round-trip
    return text

"""supervisor.toml, decoded into typed Structs. Unknown keys and bad values are rejected by key name.

Every key is described by the docstring under its field (and each table by its class docstring):
docs/configuration.md is generated from them (``python -m tools.config_reference docs/configuration.md``), and a
test fails when the page is stale.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from zserve.errors import validation_parts

PositiveInt = Annotated[int, Meta(ge=1)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
NonNegativeFloat = Annotated[float, Meta(ge=0)]
PositiveFloat = Annotated[float, Meta(gt=0)]
# A priority level's worth of waiting, in ms: finite (at most a day), as ranks are ``arrival + priority * aging``
# and inf * 0 would be NaN, which orders nothing
AgingMs = Annotated[float, Meta(gt=0, le=86_400_000)]
T = TypeVar("T")

_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_HANDLER = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
# sun_path in sockaddr_un holds 108 bytes, NUL included.
_MAX_IPC_PATH = 107


class ConfigError(ValueError):
    """supervisor.toml is unreadable or invalid; the message names the key."""


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class SupervisorConfig(_Section, kw_only=True):
    """``[supervisor]``: how ``zserve up`` (and ``zserve workers``) starts, restarts and stops its processes."""

    run_dir: str = ""
    """Directory for the ipc sockets, created 0700 and removed on exit. `""` = `$TMPDIR/zserve-UID-HASH`, derived from
    the config file's path, so that `Client.from_config` finds it. One supervisor per run dir (a lock file)."""
    max_restarts: NonNegativeInt = 5
    """Restarts of one process within `restart_window_s` before the supervisor gives up (stops everything, exits 1)."""
    restart_window_s: PositiveFloat = 60.0
    """The window, in seconds, in which `max_restarts` are counted."""
    restart_backoff_s: NonNegativeFloat = 0.5
    """First restart delay, in seconds; it doubles with each restart in the window, capped at 10 s."""
    startup_timeout_s: PositiveFloat = 600.0
    """How long to wait at start for the broker, the engines and stages, and `/readyz`."""
    shutdown_timeout_s: PositiveFloat = 20.0
    """On stop, how long engines and stages get to exit before SIGKILL."""


class BrokerConfig(_Section, kw_only=True):
    """``[broker]``: where the broker also listens for other hosts, how they authenticate, and how lost
    workers are found. Processes of this host always use ``ipc://RUN_DIR/{client,work,out}.sock``; a
    ``tcp://HOST:PORT`` here is bound as well, for direct clients (client) and worker hosts (work, out)
    elsewhere."""

    client_endpoint: str = ""
    """Also listen for direct clients of other hosts at `tcp://HOST:PORT` (processes of this host, frontends included,
    always use `ipc://RUN_DIR/client.sock`)."""
    work_endpoint: str = ""
    """Also listen for worker hosts' engines and stages at `tcp://HOST:PORT` (local ones use
    `ipc://RUN_DIR/work.sock`)."""
    out_endpoint: str = ""
    """Also take worker hosts' results at `tcp://HOST:PORT` (local ones push to `ipc://RUN_DIR/out.sock`)."""
    curve_key: str = ""
    """The broker's `NAME.key_secret` (`zserve keys generate`); required with a tcp endpoint unless `insecure`."""
    authorized_keys_dir: str = ""
    """A folder with the public `NAME.key` of every client and worker host admitted over tcp; anyone else is refused
    during the CURVE handshake and logged."""
    insecure: bool = False
    """tcp without CURVE: anyone who reaches the port is served. Binds to loopback addresses only, unless
    `insecure_any_host`."""
    insecure_any_host: bool = False
    """With `insecure`, also bind plain tcp to other addresses: only inside a network you trust."""
    heartbeat_interval_ms: PositiveInt = 250
    """Heartbeat period, both ways (broker to workers, workers to broker)."""
    heartbeat_liveness: PositiveInt = 4
    """Missed heartbeats before a worker (or, seen from a worker, the broker) counts as lost."""
    max_redispatch: NonNegativeInt = 1
    """Times a lost worker's batch is sent to another worker before its requests are answered `engine_lost`."""
    drain_timeout_s: NonNegativeFloat = 10.0
    """On stop, how long the broker waits for in-flight work before answering the rest `shutting_down`."""
    priority_aging_ms: AgingMs = 1000.0
    """How long a queued request waits to count as one `priority` level more urgent, so that a stream of urgent
    requests delays a less urgent one by at most about this times the difference of their priorities. See
    [priorities](http-api.md#priorities-tenants-and-quotas)."""

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
    """``[frontends]``: the HTTP server (gunicorn, its workers running zserve's fast predict path) in front of
    the broker."""

    # 0 = half the CPU cores, at least 1: the other half runs the broker, stages and engines. On a 2-core VM one
    # worker answered echo at c64 over HTTP 1.15x faster than two, p99 2.6 ms against 4.6 (docs/benchmarks.md):
    # wrk, the broker and the engine need the other core.
    workers: NonNegativeInt = 0
    """gunicorn worker processes (`zserve.frontends.fast_worker.FastPathWorker`: gunicorn's asgi worker with the fast
    predict path). `0` = half the usable CPU cores, at least 1."""
    host: str = "127.0.0.1"
    """Bind address."""
    port: Annotated[int, Meta(ge=1, le=65535)] = 8000
    """Bind port (`zserve up --port` overrides it)."""
    max_body_bytes: PositiveInt = 1 << 20
    """Larger request bodies are answered 413 `payload_too_large`."""
    graceful_timeout_s: NonNegativeFloat = 10.0
    """On stop, time for in-flight HTTP requests to finish."""
    api_keys_file: str = ""
    """API keys, one per line (blank lines and `#` comments skipped), read again on SIGHUP; a relative path is taken
    from the directory `zserve up` runs in. `""` = no file (keys may still come from `ZSERVE_API_KEYS`). See [API
    keys](http-api.md#api-keys)."""
    auth_health: bool = False
    """`true`: `/healthz`, `/readyz` and `/metrics` need a key too (when keys are on)."""
    max_connections: PositiveInt = 1000
    """Open HTTP connections per worker (gunicorn's `--worker-connections`). A connection past it gets its request
    answered 503 `overloaded` with `Retry-After` and `Connection: close`, never a silent close."""
    keep_alive_s: PositiveInt = 5
    """How long an idle keep-alive connection stays open, as answers advertise it (`Keep-Alive: timeout=N`). The
    server closes it one second later, so a client that reuses a connection just inside this finds it open. Behind
    a load balancer, set it above the balancer's idle timeout."""

    def __post_init__(self) -> None:
        if self.workers == 0:
            self.workers = max(1, usable_cores() // 2)


class LimitsConfig(_Section, kw_only=True):
    """``[limits]``: how much work one HTTP request may ask for, so that one caller cannot take a model's queue, an
    engine's step or its grammar compiler from the others. The frontends check them while they decode the body,
    before anything reaches the broker; past one, the answer is 400 naming the field (`prompt`, `input`, `stop`,
    ...). See [limits](http-api.md#limits-per-request)."""

    max_inputs: PositiveInt | None = None
    """Pieces of work one request may spawn: prompts x `n` of `/v1/completions` (and `/mii` prompts), inputs of
    `/v1/embeddings`, documents of `/v1/rerank`, pairs of `/v1/score`. Unset: an eighth of the model's `max_queue`
    (128 for the default 1024), at least 1."""
    max_stop: PositiveInt = 16
    """Stop strings per request (`stop`)."""
    max_stop_chars: PositiveInt = 256
    """Characters in one stop string."""
    max_logit_bias: PositiveInt = 300
    """Entries of `logit_bias` (OpenAI's own limit)."""
    max_tools: PositiveInt = 128
    """Tools of one chat request (`tools`; OpenAI's own limit)."""
    max_schema_bytes: PositiveInt = 65536
    """Bytes of a JSON schema as JSON text: `response_format`'s, `guided_json`, and all the tools' together (`tools`:
    a forced `tool_choice` compiles them as one grammar)."""
    max_schema_depth: PositiveInt = 32
    """Nesting of objects and arrays in one schema (an object property that is an object is two levels: the
    `properties` table and the property's schema)."""
    max_schema_properties: PositiveInt = 256
    """Object properties in one schema, counted over every `properties` table in it (the tools': over all of them).
    The grammar compile's time grows with them: thousands of optional properties took minutes."""

    def inputs_for(self, model: ModelConfig) -> int:
        """``max_inputs`` for ``model``: the configured number, else an eighth of its queue."""
        return self.max_inputs if self.max_inputs is not None else max(1, model.max_queue // 8)


class ModelConfig(_Section, kw_only=True):
    """``[[models]]``: one table per model served."""

    name: str
    """The model's name in routes and clients: letters, digits, `.`, `_` and `-`, up to 64 characters."""
    handler: str
    """`"package.module:Class"`, a `zserve.Model` subclass."""
    engines: PositiveInt = 1
    """Engine processes."""
    max_batch_size: PositiveInt = 32
    """Items per batch at most."""
    max_wait_ms: NonNegativeFloat = 5.0
    """How long the oldest queued item may wait for a fuller batch while every engine is busy (an idle engine takes
    what is queued at once)."""
    # zserve/batching/scheduler.py states the fairness bound.
    max_batch_cost: NonNegativeInt = 0
    """Cost-aware batching. `0` batches by count only; otherwise a batch costs its size times its largest item's cost
    (the handler's `cost(item)`: tokens for the text handlers, pixels for images), is closed before it would pass this
    budget, and groups items of similar cost. See [cost-aware batching](models-and-tasks.md#cost-aware-batching)."""
    max_queue: PositiveInt = 1024
    """Queued items before new requests are answered 503 `overloaded`. With tenants, one that holds less than its
    share of a full queue makes room: the newest request of the tenant holding the most past its share is answered
    503 instead ([a full queue](http-api.md#priorities-tenants-and-quotas))."""
    timeout_ms: PositiveInt = 30_000
    """Default deadline per request (clients may pass their own): past it the request is answered 504
    `deadline_exceeded`, and not computed if it is still queued."""
    credits: PositiveInt = 2
    """Batches an engine may hold at once: 2 = one running, one staged (hides the hop); 1 = batches form until the
    engine is free (best for CPU-bound models)."""
    batch_timeout_s: PositiveFloat | None = None
    """A worker (engine or stage) that holds work and makes no progress (no result, no engine step) for this long is
    hung: its batches are re-dispatched once, the broker tells it to exit (`Replace`: exit code 3) and SIGKILLs it if
    it runs on the broker's host, and its supervisor starts a fresh one (`workers_hung` in `zserve status` and
    `/metrics`). Unset: the larger of `timeout_ms` and 10x the slowest recent batch (or engine step) of the model. A
    worker stalled on a suspect (an item of a batch that hung, re-dispatched alone) is hung after 4x the slowest
    batch, at least 0.5 s, never more than this. See [failure behaviour](operations.md#failure-behaviour)."""
    threads: PositiveInt = 1
    """torch intra-op threads per engine (also `OMP_NUM_THREADS`). 1 is the safe default on a shared machine: more
    threads than free cores collapse torch's throughput. Only the engine's compute thread gets them; its main thread
    runs OpenMP serially (a second OpenMP team in the process made an engine step 1.3x as long)."""
    devices: list[str] = []
    """Engine i runs on `devices[i % len(devices)]`, e.g. `["cuda:0", "cuda:1"]`; `[]` = `"cpu"`. For `cuda:N` the
    supervisor sets `CUDA_VISIBLE_DEVICES=N` and the engine's `setup(device)` gets `cuda:0`; `cuda:N,M` gives one
    engine several devices (a `tensor_parallel` group). `zserve up` and `zserve workers` refuse a `cuda:N` this host
    does not have (counted without torch: `ZSERVE_GPU_COUNT`, else `/proc/driver/nvidia/gpus`, else `nvidia-smi -L`)."""
    engines_per_device: PositiveInt | None = None
    """Set: `engines = len(devices) x engines_per_device`, the same number on every device."""
    options: dict[str, Any] = {}
    """`[models.options]`: keyword arguments for the handler's constructor, e.g. `path` for the built-in handlers
    ([models and tasks](models-and-tasks.md), [generation](generation.md#engine-options))."""
    preprocess_workers: Annotated[int, Meta(ge=1)] | None = None
    """Stage processes, for a model that overrides `preprocess`. Unset: the cores the engines leave free, `max(1,
    (cores - sum of engines x threads) // models with a stage)` (`preprocess_workers_for`)."""
    routing: Literal["auto", "cache_aware", "least_loaded"] = "auto"
    """Generative models: which engine gets a request. `"cache_aware"`: the one whose prefix cache holds most of its
    prompt, unless that engine runs far more sequences than the least loaded one (then that one); `"least_loaded"`:
    the engine running the fewest sequences. `"auto"`: cache_aware when `engines` > 1. See
    [routing](generation.md#routing-across-engines)."""

    def routes_by_cache(self, generative: bool) -> bool:
        """Whether this model's requests are routed cache_aware (``routing`` resolved)."""
        return generative and (self.routing == "cache_aware" or (self.routing == "auto" and self.engines > 1))

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


class TenantConfig(_Section, kw_only=True):
    """``[[tenants]]``: one per tenant, the callers that share a weight and quotas. An API key names its tenant in the
    keys file (`KEY tenant=NAME`); a direct client may name one itself. Quotas are checked by the broker when it
    admits a request; past one, the answer is 429 naming it (`field`) with `Retry-After`. See [priorities, tenants
    and quotas](http-api.md#priorities-tenants-and-quotas)."""

    name: str
    """The tenant's name, as API keys give it (`tenant=NAME`)."""
    weight: PositiveFloat = 1.0
    """Its share of each model when tenants compete: served cost (tokens, else requests) in the ratio of the
    weights of the tenants that have requests waiting."""
    requests_per_s: NonNegativeFloat = 0.0
    """Requests admitted per second (a token bucket holding one second's worth); 0 = no limit."""
    tokens_per_min: NonNegativeFloat = 0.0
    """Tokens admitted per minute, counted by the request's cost (prompt tokens; 1 for a model without a cost
    function), a token bucket holding one minute's worth; 0 = no limit."""
    max_concurrent: NonNegativeInt = 0
    """Requests pending in the broker (queued or computing) at once; 0 = no limit."""


class Config(_Section, kw_only=True):
    """The whole supervisor.toml: four tables, one ``[[models]]`` table per model and one ``[[tenants]]`` table per
    tenant."""

    supervisor: SupervisorConfig = msgspec.field(default_factory=SupervisorConfig)
    broker: BrokerConfig = msgspec.field(default_factory=BrokerConfig)
    frontends: FrontendsConfig = msgspec.field(default_factory=FrontendsConfig)
    limits: LimitsConfig = msgspec.field(default_factory=LimitsConfig)
    models: list[ModelConfig] = []
    tenants: list[TenantConfig] = []

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("at least one [[models]] table is required")
        tenants = [t.name for t in self.tenants]
        if len(set(tenants)) != len(tenants):
            raise ValueError(f"tenant names must be unique: {', '.join(sorted(tenants))}")
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


def _drop_retired_keys(data: Any, source: str) -> None:
    # [frontends] server chose between gunicorn and granian; granian was removed (0.38x gunicorn's rate with the
    # fast path, and it could not take the supervisor's socket), and files that `zserve serve --print-config` wrote
    # say server = "gunicorn": those still load, with a warning. Any other server cannot be honoured.
    frontends = data.get("frontends") if isinstance(data, dict) else None
    if not isinstance(frontends, dict) or "server" not in frontends:
        return
    server = frontends.pop("server")
    if server != "gunicorn":
        raise ConfigError(
            f"{source}: frontends.server = {server!r}: the granian frontend server was removed; gunicorn is the only "
            "one (delete the line)"
        )
    warnings.warn(
        f"{source}: frontends.server is deprecated and ignored (gunicorn is the only frontend server); delete the line",
        FutureWarning,
        stacklevel=2,
    )


def decode_toml(data: bytes | str, type_: type[T], source: str) -> T:
    """``data`` (TOML) as ``type_``; a ConfigError naming the key the way the file spells it."""
    try:
        raw = msgspec.toml.decode(data)
        _drop_retired_keys(raw, source)
        return msgspec.convert(raw, type_)
    except msgspec.ValidationError as exc:
        message, path = validation_parts(exc)
        raise ConfigError(f"{source}: {path or '(top level)'}: {message}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None


def load_toml(path: str | os.PathLike[str], type_: type[T]) -> T:
    """The TOML file at ``path`` as ``type_`` (``Config``, ``WorkersConfig``); a ConfigError when it is unreadable
    or invalid."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    return decode_toml(data, type_, str(path))


def parse_config(data: bytes | str, source: str = "supervisor.toml") -> Config:
    return decode_toml(data, Config, source)


def load_config(path: str | os.PathLike[str]) -> Config:
    return load_toml(path, Config)


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
    preprocess: bool = False  # has a preprocess stage: /readyz also waits for one
    max_batch_cost: int = 0  # > 0: the frontends report each item's cost (``Model.cost``) with its Submit
    max_inputs: int = 128  # [limits] max_inputs for this model, resolved
    route_blocks: bool = False  # routed cache_aware if generative: requests carry their prompt's block hashes


class FrontendSettings(msgspec.Struct, kw_only=True):
    """Handed by the supervisor to each gunicorn worker (env ZSERVE_FRONTEND, as JSON)."""

    client_endpoint: str
    models: list[ServedModel]
    max_body_bytes: int = 1 << 20
    api_keys_file: str = ""  # absolute (resolved where `zserve up` runs)
    auth_health: bool = False
    probe_key: str = ""  # the supervisor's own key, accepted on the health routes only (its /readyz polls)
    limits: LimitsConfig = msgspec.field(default_factory=LimitsConfig)

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
                    preprocess=m.name in staged,
                    max_batch_cost=m.max_batch_cost,
                    max_inputs=config.limits.inputs_for(m),
                    route_blocks=m.routes_by_cache(True),
                )
                for m in config.models
            ],
            max_body_bytes=config.frontends.max_body_bytes,
            api_keys_file=str(Path(f.api_keys_file).expanduser().resolve()) if f.api_keys_file else "",
            auth_health=f.auth_health,
            probe_key=probe_key,
            limits=config.limits,
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
    for section in ("supervisor", "broker", "frontends", "limits"):
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in data[section].items() if value is not None]
        lines.append("")
    for model in data["models"]:
        options = model.pop("options", {})
        lines.append("[[models]]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in model.items() if value is not None]
        if options:
            lines.append("[models.options]")
            lines += [f"{key} = {_toml_value(value)}" for key, value in options.items()]
        lines.append("")
    for tenant in data.get("tenants", []):
        lines.append("[[tenants]]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in tenant.items() if value is not None]
        lines.append("")
    text = "\n".join(lines)
    parse_config(text, "generated supervisor.toml")  # fail here, not in `zserve up`, if it does not round-trip
    return text

"""The scenarios of one bench run, each appending Measurements to the Session: the bare zmq round trip, the
in-process limit, zserve (HTTP and the direct client, one deployment), the naive baseline, the peers (mosec,
service-streamer) and the broker's capacity."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.capacity import broker_alone, client_submit
from bench.common import loadgen
from bench.common.catalog import ModelPlan, clean_env, thread_env
from bench.common.measure import BROKER_ALONE, HTTP, INPROCESS, MOSEC, NAIVE, STREAMER, Measurement
from bench.common.paths import with_repo_path
from bench.common.procs import Managed, free_port, naive_up, zserve_up
from bench.serving import peers, zmq_rtt
from zserve.config import Config

ECHO_HANDLER = "zserve.models.echo:Echo"
EMBED_HANDLER = "zserve.models.embedding:SentenceEmbedding"


@dataclass
class Session:
    """What every scenario needs, and what they all add to."""

    config: Config  # the deployment under test (already narrowed to the models and thread count of this run)
    config_path: Path  # ... written out as a supervisor.toml, with a free port
    plans: list[ModelPlan]
    work: Path  # a temporary folder for Lua scripts and ready files
    concurrency: list[int]
    duration_s: float
    warmup_s: float
    scenarios: list[str]
    naive_threads: int = 1  # torch threads per naive worker
    verbose: bool = False
    broker_engines: int = 3  # the broker-capacity scenario: no-op engines,
    broker_batch: int = 256  # ... their max_batch_size,
    broker_clients: int = 2  # ... client processes,
    broker_window: int = 512  # ... and requests each keeps in flight
    peer_config_path: Path | None = None  # what the naive server and the peers load (default: config_path)
    results: list[Measurement] = field(default_factory=list)
    rtt: dict[str, float] | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    def add(self, m: Measurement, extra: str = "") -> None:
        self.results.append(m)
        where = f"b{m.batch}" if m.scenario == INPROCESS else f"c{m.concurrency}"
        errors = f"  {m.errors} errors" if m.errors else ""
        print(
            f"  {m.scenario:<14} {m.model:<8} {where:>4}  {m.qps:10.1f}/s  p50 {m.p50_ms:8.2f} ms  "
            f"p99 {m.p99_ms:8.2f} ms{errors}{extra}",
            flush=True,
        )

    def lua(self, plan: ModelPlan) -> Path:
        return loadgen.write_lua(self.work / f"{plan.name}.lua", plan.body_bytes)


# ---- the bare round trip and the in-process limit ----


def run_rtt(s: Session) -> None:
    body = next((p.body_bytes for p in s.plans if p.config.handler == ECHO_HANDLER), b'{"x":1}')
    s.rtt = rtt = zmq_rtt.measure(body, duration_s=min(s.duration_s, 3.0))
    print(
        f"  bare pyzmq DEALER<->ROUTER over ipc: round trip p50 {rtt['rtt_p50_us']:.1f} us, "
        f"p99 {rtt['rtt_p99_us']:.1f} us -> {rtt['per_hop_us']:.1f} us per hop "
        f"({rtt['round_trips']} sequential round trips, {rtt['payload_bytes']}-byte frame)",
        flush=True,
    )


def run_inprocess(s: Session) -> None:
    """Each model in a fresh process with the engine's thread settings (bench/serving/inprocess.py)."""
    for plan in s.plans:
        argv = [sys.executable, "-m", "bench.serving.inprocess", "--config", str(s.config_path), "--model", plan.name,
                "--body-json", json.dumps(plan.body), "--duration-s", str(s.duration_s)]  # fmt: skip
        proc = subprocess.run(argv, capture_output=True, text=True, env=with_repo_path(thread_env(plan.threads)),
                              timeout=s.duration_s + 600, check=False)  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"in-process measurement of {plan.name} failed:\n{proc.stderr[-3000:]}")
        stats = json.loads(proc.stdout.strip().splitlines()[-1])
        m = Measurement(scenario=INPROCESS, model=plan.name, concurrency=None, qps=stats["items_per_s"],
                        p50_ms=stats["call_p50_ms"], p99_ms=stats["call_p99_ms"], requests=stats["items"], errors=0,
                        duration_s=stats["elapsed_s"], batch=stats["batch"], detail=stats)  # fmt: skip
        s.add(m, f"  ({stats['calls']} calls, torch threads {stats['torch_threads']})")


# ---- where the CPU goes ----


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # wrk's, once it has been waited for
    return usage.ru_utime + usage.ru_stime


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # the direct client's coroutines (and this script)
    return usage.ru_utime + usage.ru_stime


def _record_cpu(m: Measurement, before: dict[str, float], after: dict[str, float], load: tuple[str, float]) -> None:
    """CPU of the measured run by process role (plus the load generator's): ms per answered request, and cores."""
    used = {role: after[role] - before.get(role, 0.0) for role in after}
    used[load[0]] = load[1]
    answered = m.requests - m.errors
    if answered > 0 and m.duration_s > 0:
        m.detail["cpu_ms_per_request"] = {role: sec * 1000.0 / answered for role, sec in sorted(used.items())}
        m.detail["cpu_cores_used"] = {role: sec / m.duration_s for role, sec in sorted(used.items())}


def _notes(m: Measurement) -> str:
    parts = []
    if (batch := m.detail.get("mean_batch_size")) is not None:
        parts.append(f"mean batch {batch:.1f}")
    if (queue := m.detail.get("mean_queue_ms")) is not None:
        parts.append(f"queue {queue:.2f} ms")
    per_request = m.detail.get("cpu_ms_per_request") or {}
    cpu = ", ".join(f"{role} {ms:.3f}" for role, ms in per_request.items() if role != "supervisor" and ms >= 0.0005)
    if cpu:
        parts.append(f"cpu ms/req: {cpu}")
    return f"  ({'; '.join(parts)})" if parts else ""


# ---- load against a running server ----


def measure_http(s: Session, server: Managed, base_url: str, scenario: str, plan: ModelPlan, c: int) -> Measurement:
    url = f"{base_url}/v1/models/{plan.name}/predict"
    lua = s.lua(plan)
    server.wait_idle()
    if s.warmup_s > 0:
        loadgen.run_wrk(url, lua, c, s.warmup_s)
    idle_s = server.wait_idle()  # what the warm-up left queued must not count against the measured run
    batches = loadgen.batch_size_totals(base_url, plan.name) if scenario == HTTP else None
    cpu, wrk_cpu = server.cpu_by_role(), _children_cpu_s()
    m = loadgen.wrk_measurement(scenario, plan.name, c, loadgen.run_wrk(url, lua, c, s.duration_s))
    _record_cpu(m, cpu, server.cpu_by_role(), ("wrk", _children_cpu_s() - wrk_cpu))
    after = loadgen.batch_size_totals(base_url, plan.name) if scenario == HTTP else None
    if batches and after and after[1] > batches[1]:
        m.detail["mean_batch_size"] = (after[0] - batches[0]) / (after[1] - batches[1])
    m.detail["idle_wait_s"] = idle_s
    return m


def measure_direct(s: Session, server: Managed, plan: ModelPlan, c: int) -> Measurement:
    server.wait_idle()
    before: dict[str, Any] = {}

    def snapshot() -> None:  # between the warm-up and the measured run
        before.update(server=server.cpu_by_role(), client=_own_cpu_s())

    m = loadgen.measure_direct(s.config_path, plan.name, plan.body, c, s.duration_s, s.warmup_s, snapshot)
    _record_cpu(m, before["server"], server.cpu_by_role(), ("client", _own_cpu_s() - before["client"]))
    return m


def run_zserve(s: Session) -> None:
    """One deployment for both zserve scenarios: per model and concurrency, HTTP then the direct client."""
    print("starting zserve ...", flush=True)
    # The supervisor gives up after its own startup_timeout_s; wait a little longer than that for its verdict.
    wait_s = s.config.supervisor.startup_timeout_s + 30
    server, base_url = zserve_up(s.config_path, wait_s, echo=s.verbose, env=clean_env())
    try:
        print(f"zserve ready at {base_url}", flush=True)
        for plan in s.plans:
            if HTTP_KEY in s.scenarios:
                loadgen.check_endpoint(f"{base_url}/v1/models/{plan.name}/predict", plan.body_bytes)
            for c in s.concurrency:
                if HTTP_KEY in s.scenarios:
                    m = measure_http(s, server, base_url, HTTP, plan, c)
                    s.add(m, _notes(m))
                if DIRECT_KEY in s.scenarios:
                    m = measure_direct(s, server, plan, c)
                    s.add(m, _notes(m))
    finally:
        print("stopping zserve ...", flush=True)
        s.notes["zserve_strays"] = server.close()
        s.notes["zserve_exit_code"] = server.proc.returncode if server.proc else None
        s.notes["zserve_notable_lines"] = server.notable


def run_naive(s: Session) -> None:
    workers = s.config.frontends.workers
    threads = s.naive_threads
    print(f"starting the naive baseline ({workers} gunicorn workers, {threads} torch thread(s) each) ...", flush=True)
    names = [p.name for p in s.plans]
    config_path = s.peer_config_path or s.config_path
    ready = s.work / "naive-ready"
    server, base_url = naive_up(config_path, names, free_port(), workers, threads, ready, echo=s.verbose)
    try:
        for plan in s.plans:
            loadgen.check_endpoint(f"{base_url}/v1/models/{plan.name}/predict", plan.body_bytes)
            for c in s.concurrency:
                m = measure_http(s, server, base_url, NAIVE, plan, c)
                s.add(m, _notes(m))
    finally:
        print("stopping the naive baseline ...", flush=True)
        s.notes["naive_strays"] = server.close()
        s.notes["naive_notable_lines"] = server.notable


def run_peer(s: Session, scenario: str) -> None:
    """mosec or service-streamer, serving every model of the run at zserve's route, with the engines' threads."""
    why = peers.missing(scenario)
    if why:
        print(f"skipping {scenario}: {why}", flush=True)
        s.notes.setdefault("skipped", {})[scenario] = why
        return
    threads = max(p.threads for p in s.plans)  # every model of a run has the same threads when --threads is given
    print(f"starting {scenario} (one worker process per model, {threads} torch thread(s) each) ...", flush=True)
    config_path = s.peer_config_path or s.config_path
    server, base_url = peers.peer_up(scenario, config_path, [p.name for p in s.plans], threads, echo=s.verbose)
    try:
        for plan in s.plans:
            loadgen.check_endpoint(f"{base_url}/v1/models/{plan.name}/predict", plan.body_bytes)
        s.notes[f"{scenario}_idle_cores"] = idle = server.learn_idle()  # after the first requests: models loaded
        print(f"  {scenario} uses {idle:.2f} cores with no load (allowed for when waiting for it to go idle)")
        for plan in s.plans:
            for c in s.concurrency:
                m = measure_http(s, server, base_url, scenario, plan, c)
                s.add(m, _notes(m))
    finally:
        print(f"stopping {scenario} ...", flush=True)
        s.notes[f"{scenario}_strays"] = server.close()
        s.notes[f"{scenario}_notable_lines"] = server.notable


def run_capacity(s: Session) -> None:
    print(f"starting the broker-capacity deployment ({s.broker_engines} no-op engines, batches of {s.broker_batch}; "
          f"{s.broker_clients} client processes x {s.broker_window} in flight) ...", flush=True)  # fmt: skip
    m = client_submit.measure(s.work, s.broker_engines, s.broker_batch, s.broker_clients, s.broker_window,
                         s.duration_s, s.warmup_s, s.verbose)  # fmt: skip
    d, extra = m.detail, ""
    if d["broker_cpu_us_per_item"] is not None:
        extra = (f"  (broker {d['broker_cpu_us_per_item']:.1f} us CPU/item, {d['broker_cores_used']:.2f} cores; "
                 f"one broker core ~ {d['broker_items_per_core_s'] or 0:,.0f} items/s)")  # fmt: skip
    s.add(m, extra + _notes(m))


# The broker alone (bench/capacity/broker_alone.py): 4 no-op workers, 2 raw clients x 4 Submits of 256 items.
ALONE_WORKERS, ALONE_CLIENTS, ALONE_ITEMS, ALONE_WINDOW = 4, 2, 256, 4


def run_broker_alone(s: Session) -> None:
    print(f"starting the broker alone ({ALONE_WORKERS} no-op workers, {ALONE_CLIENTS} raw clients x {ALONE_WINDOW} "
          f"Submits of {ALONE_ITEMS} items) ...", flush=True)  # fmt: skip
    row = broker_alone.measure(ALONE_WORKERS, ALONE_CLIENTS, ALONE_ITEMS, ALONE_WINDOW, s.duration_s)
    m = Measurement(
        scenario=BROKER_ALONE,
        model=broker_alone.MODEL,
        concurrency=ALONE_CLIENTS * ALONE_WINDOW * ALONE_ITEMS,
        qps=row["items_per_s"],
        p50_ms=0.0,
        p99_ms=0.0,
        requests=row["answered"] + row["errors"],
        errors=row["errors"],
        duration_s=row["seconds"],
        detail=row,
    )
    s.add(m, f"  (broker {row['broker_us_per_item']:.2f} us CPU/item, {row['broker_cores']:.2f} cores)")


# --scenarios keys, in the order they run.
RTT_KEY, INPROCESS_KEY, HTTP_KEY, DIRECT_KEY, NAIVE_KEY = "rtt", "inprocess", "http", "direct", "naive"
MOSEC_KEY, STREAMER_KEY, BROKER_KEY, BROKER_ALONE_KEY = "mosec", "streamer", "broker", "broker-alone"
ALL = (RTT_KEY, INPROCESS_KEY, HTTP_KEY, DIRECT_KEY, NAIVE_KEY, MOSEC_KEY, STREAMER_KEY, BROKER_KEY, BROKER_ALONE_KEY)


def run_all(s: Session) -> None:
    if RTT_KEY in s.scenarios:
        run_rtt(s)
    if INPROCESS_KEY in s.scenarios:
        run_inprocess(s)
    if HTTP_KEY in s.scenarios or DIRECT_KEY in s.scenarios:
        run_zserve(s)
    if NAIVE_KEY in s.scenarios:
        run_naive(s)
    if MOSEC_KEY in s.scenarios:
        run_peer(s, MOSEC)
    if STREAMER_KEY in s.scenarios:
        run_peer(s, STREAMER)
    if BROKER_KEY in s.scenarios:
        run_capacity(s)
    if BROKER_ALONE_KEY in s.scenarios:
        run_broker_alone(s)

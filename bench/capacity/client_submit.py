"""Broker capacity: how many items per second one broker process moves, and its CPU per item.

A deployment of its own: one model, ``noop`` (zserve's echo handler, whose ``predict`` returns its batch), on
several engines with large batches, so that engines are never the limit; ``--broker-clients`` client
processes each keep ``--broker-window`` requests in flight through the public ``zserve.Client.submit`` API (one
thread submitting, a new request as each answer arrives). Whatever the client does to coalesce its sends
(one message per IO-thread turn) is measured with it.

All clients measure over the same wall-clock window (a start time given to them); the bench reads the broker
process's CPU (psutil) at both ends of that window. Reported: items/s, the broker's CPU microseconds per item,
and ``1 / (broker CPU per item)``: the items/s one broker core would move if it had a whole core. On 2
shared cores the clients and engines take most of the CPU, so the measured items/s is a floor.

``python -m bench.capacity.client_submit --client ...`` is one client process (started by the bench; prints one JSON
line).
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.common.catalog import clean_env
from bench.common.measure import BROKER, Measurement, percentile
from bench.common.paths import with_repo_path
from bench.common.procs import free_port, zserve_up

MODEL = "noop"
BODY = {"x": 1}
START_DELAY_S = 3.0  # time for the client processes to import zserve and connect before the window opens


def deployment(port: int, engines: int, batch: int) -> str:
    return f"""
[frontends]
workers = 1
port = {port}

[[models]]
name = "{MODEL}"
handler = "zserve.models.echo:Echo"
engines = {engines}
max_batch_size = {batch}
max_wait_ms = 1
max_queue = 65536
timeout_ms = 60000
credits = 2
"""


# ---- one client process ----


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def client_main(config: str, window: int, warmup_at: float, start_at: float, end_at: float) -> dict[str, Any]:
    """Keep ``window`` requests in flight from ``warmup_at`` to ``end_at`` (wall clock); count the answers that
    arrive in [start_at, end_at)."""
    from zserve import Client

    slots = threading.BoundedSemaphore(window)
    latencies: list[float] = []
    errors = [0]
    cpu: dict[str, float] = {}

    def done(t0: float, future: Any) -> None:  # on the client's IO thread
        now = time.time()
        if start_at <= now < end_at:
            if future.exception() is None:
                latencies.append(now - t0)
            else:
                errors[0] += 1
        slots.release()

    with Client.from_config(config) as client:
        while time.time() < warmup_at:
            time.sleep(0.01)
        while (now := time.time()) < end_at:
            if "start" not in cpu and now >= start_at:
                cpu["start"] = _cpu_s()
            if slots.acquire(timeout=0.1):
                client.submit(MODEL, BODY).add_done_callback(functools.partial(done, time.time()))
        cpu["end"] = _cpu_s()
        for _ in range(window):  # let what is in flight finish before the client closes
            slots.acquire(timeout=30)
    latencies.sort()
    return {
        "answered": len(latencies),
        "errors": errors[0],
        "p50_ms": percentile(latencies, 50) * 1000.0,
        "p99_ms": percentile(latencies, 99) * 1000.0,
        "cpu_s": cpu["end"] - cpu.get("start", cpu["end"]),
    }


# ---- the scenario ----


def measure(
    work: Path, engines: int, batch: int, clients: int, window: int, duration_s: float, warmup_s: float, echo: bool
) -> Measurement:
    config = work / "capacity.toml"
    config.write_text(deployment(free_port(), engines, batch))
    server, _ = zserve_up(config, 300.0, echo=echo, env=clean_env())
    procs: list[subprocess.Popen[str]] = []
    try:
        warmup_at = time.time() + START_DELAY_S
        start_at = warmup_at + warmup_s
        end_at = start_at + duration_s
        argv = [sys.executable, "-m", "bench.capacity.client_submit", "--client", "--config", str(config),
                "--window", str(window), "--warmup-at", repr(warmup_at), "--start-at", repr(start_at),
                "--end-at", repr(end_at)]  # fmt: skip
        procs = [
            subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=with_repo_path(clean_env()))
            for _ in range(clients)
        ]
        time.sleep(max(0.0, start_at - time.time()))
        before = server.cpu_by_role()
        time.sleep(max(0.0, end_at - time.time()))
        after = server.cpu_by_role()
        reports = []
        for proc in procs:
            out, _ = proc.communicate(timeout=120)
            if proc.returncode != 0:
                raise RuntimeError(f"a broker-capacity client exited {proc.returncode}")
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        server.close()
    answered = sum(r["answered"] for r in reports)
    errors = sum(r["errors"] for r in reports)
    used = {role: after.get(role, 0.0) - before.get(role, 0.0) for role in after}
    used["client"] = sum(r["cpu_s"] for r in reports)
    broker_s = used.get("broker", 0.0)
    m = Measurement(
        scenario=BROKER,
        model=MODEL,
        concurrency=clients * window,
        qps=answered / duration_s,
        p50_ms=max(r["p50_ms"] for r in reports),  # the worst client's: a conservative summary
        p99_ms=max(r["p99_ms"] for r in reports),
        requests=answered + errors,
        errors=errors,
        duration_s=duration_s,
        detail={
            "engines": engines,
            "max_batch_size": batch,
            "clients": clients,
            "window_per_client": window,
            "clients_report": reports,
            "broker_cpu_us_per_item": broker_s * 1e6 / answered if answered else None,
            "broker_cores_used": broker_s / duration_s,
            "broker_items_per_core_s": answered / broker_s if broker_s > 0 else None,
        },
    )
    if answered:
        m.detail["cpu_ms_per_request"] = {role: s * 1000.0 / answered for role, s in sorted(used.items())}
        m.detail["cpu_cores_used"] = {role: s / duration_s for role, s in sorted(used.items())}
    return m


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--client", action="store_true", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--window", type=int, required=True)
    parser.add_argument("--warmup-at", type=float, required=True)
    parser.add_argument("--start-at", type=float, required=True)
    parser.add_argument("--end-at", type=float, required=True)
    args = parser.parse_args()
    report = client_main(args.config, args.window, args.warmup_at, args.start_at, args.end_at)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()

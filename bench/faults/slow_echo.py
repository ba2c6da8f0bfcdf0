"""The deployment and load of the fault benchmarks (overload.py, soak.py): ``zserve up`` serving SlowEcho
(tests/support/testmodels.py: each batch of up to ``batch`` items sleeps ``delay_s``, a fixed simulated
device cost, so capacity is known: engines x batch / delay_s items/s) behind gunicorn; HTTP clients on
keep-alive connections, each outcome counted; the memory and open files of every zserve process."""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

from bench.common.paths import REPO
from bench.common.procs import Managed, zserve_up
from zserve.transport import free_tcp_port

CONFIG = """
[frontends]
workers = 2
port = {port}

[[models]]
name = "slow"
handler = "testmodels:SlowEcho"
engines = {engines}
max_batch_size = {batch}
max_wait_ms = 2
max_queue = {max_queue}
timeout_ms = 10000
[models.options]
delay_s = {delay_s}
"""


def deploy(tmp: Path, engines: int, batch: int, delay_s: float, max_queue: int, port: int = 0) -> tuple[Managed, str]:
    config = tmp / "slow_echo.toml"
    config.write_text(CONFIG.format(port=port or free_tcp_port(), engines=engines, batch=batch,
                                    max_queue=max_queue, delay_s=delay_s))  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO / "tests" / "support"))
    return zserve_up(config, startup_timeout_s=120, env=env)


def family(root_pid: int) -> list[psutil.Process]:
    """``root_pid`` (the supervisor) and every process below it: broker, engines, gunicorn and its workers."""
    root = psutil.Process(root_pid)
    return [root, *root.children(recursive=True)]


def rss_mb(root_pid: int) -> float:
    """The summed RSS of every zserve process."""
    total = 0
    for p in family(root_pid):
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def open_fds(root_pid: int) -> int:
    """The summed open file descriptors (sockets, pipes, files) of every zserve process."""
    total = 0
    for p in family(root_pid):
        try:
            total += p.num_fds()
        except psutil.NoSuchProcess:
            pass
    return total


class Load:
    """``clients`` threads, each with a keep-alive connection to the SlowEcho route, POSTing as soon as an
    answer comes back (closed loop) or, with ``rate_per_s``, each on its own fixed schedule of
    ``rate_per_s / clients`` requests/s (open loop: a late answer does not slow the offered load, up to
    ``clients`` in flight). Every outcome is counted; each 200's (finish time, latency) is kept."""

    def __init__(self, url: str, clients: int, rate_per_s: float | None = None) -> None:
        self.host, port = url.removeprefix("http://").rsplit(":", 1)
        self.port = int(port)
        self.interval_s = clients / rate_per_s if rate_per_s else 0.0
        self.outcomes: Counter = Counter()
        self.latencies: list[tuple[float, float]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(clients)]

    def _connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=30)

    def _run(self, k: int) -> None:
        conn = self._connect()
        n = 0
        # Spread the clients' schedules over one interval, so an open loop offers a steady rate.
        due = time.monotonic() + self.interval_s * k / max(1, len(self.threads))
        while not self.stop.is_set():
            if self.interval_s:
                wait = due - time.monotonic()
                if wait > 0 and self.stop.wait(wait):
                    break
                due += self.interval_s
            n += 1
            started = time.monotonic()
            try:
                conn.request("POST", "/v1/models/slow/predict", json.dumps({"i": f"{k}-{n}"}),
                             {"Content-Type": "application/json"})  # fmt: skip
                resp = conn.getresponse()
                data = resp.read()
                outcome = 200 if resp.status == 200 else f"{resp.status} {json.loads(data)['error']['type']}"
            except (OSError, http.client.HTTPException) as exc:
                outcome = f"closed {type(exc).__name__}"
                conn.close()
                conn = self._connect()
            finished = time.monotonic()
            with self.lock:
                self.outcomes[outcome] += 1
                if outcome == 200:
                    self.latencies.append((finished, finished - started))
        conn.close()

    def start(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def snapshot(self) -> tuple[Counter, int]:
        with self.lock:
            return Counter(self.outcomes), len(self.latencies)

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)


def percentile_ms(latencies_s: list[float], q: float) -> float | None:
    if not latencies_s:
        return None
    ordered = sorted(latencies_s)
    return round(ordered[int(q * (len(ordered) - 1))] * 1000, 2)


def window(load: Load, before: tuple[Counter, int], after: tuple[Counter, int], seconds: float) -> dict[str, Any]:
    """What ``load`` answered between two snapshots: rates, outcomes, p50/p99 of the 200s."""
    outcomes = after[0] - before[0]
    with load.lock:
        lat = [d for _, d in load.latencies[before[1] : after[1]]]
    return {"seconds": round(seconds, 2), "ok_per_s": round(outcomes[200] / seconds, 1),
            "answers_per_s": round(sum(outcomes.values()) / seconds, 1),
            "outcomes": {str(k): v for k, v in outcomes.items()},
            "p50_ms": percentile_ms(lat, 0.50), "p99_ms": percentile_ms(lat, 0.99)}  # fmt: skip


def run_phase(url: str, clients: int, warmup_s: float, duration_s: float) -> dict[str, Any]:
    """A closed loop of ``clients``; counts only what was answered after ``warmup_s``."""
    load = Load(url, clients).start()
    time.sleep(warmup_s)
    before, t0 = load.snapshot(), time.monotonic()
    time.sleep(duration_s)
    after, elapsed = load.snapshot(), time.monotonic() - t0
    load.finish()
    return {"clients": clients, **window(load, before, after, elapsed)}

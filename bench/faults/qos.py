"""QoS: priorities, fair share and quotas over HTTP (issue 37). A ``zserve up`` deployment of SlowEcho (tests/support:
each batch of up to ``--batch`` items sleeps ``--delay-s``, so the engine's capacity is known) behind gunicorn, with API
keys naming tenants; every caller is a keep-alive HTTP client thread. Phases, one deployment, one run:

- ``fair``: tenants ``a`` and ``b`` of equal weight, ``a`` with 10x the clients of ``b`` (10x the requests outstanding,
  both past half the engine): the share of requests served to each (each should be 0.5); then ``c`` and ``d``,
  weights 3:1, same load (0.75 / 0.25).
- ``priority``: a bulk stream keeping the queue about five batches deep, and a sparse stream of the same tenant
  (about a tenth of the requests) sent with ``X-Zserve-Priority: -10``, then again at 0 (no priorities); the floor is
  the sparse stream's latency when the bulk keeps the engine exactly busy with nothing queued.
- ``quota``: tenant ``capped`` (``requests_per_s`` = ``--quota-rps``) offered 3x its quota: its 200s per second
  against the quota, every 429 with Retry-After; then a client that honours Retry-After; meanwhile tenant ``b``'s p50
  against its latency alone.
- ``flood``: no deployment, the pure broker core on a fake clock (``bench.faults.qos_flood``): an open loop of one
  tenant at 10x the other's rate against a full ``max_queue``, with the full-queue rule and without it (the arrival
  always refused), then both tenants past their share, weights 1:1 and 3:1.

    .venv/bin/python -m bench.faults qos --out bench/results/37-qos.json
    .venv/bin/python -m bench.faults qos --phases flood
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import subprocess
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common.paths import REPO
from bench.common.procs import zserve_up
from bench.faults.qos_flood import admission_cost_us, flood
from bench.faults.slow_echo import percentile_ms
from zserve.transport import free_tcp_port

KEYS = {name: f"zs-qos-{name}-0123456789" for name in ("a", "b", "c", "d", "bulk", "capped")}
CONFIG = """
[frontends]
workers = 1
port = {port}
api_keys_file = "{keys}"

[[models]]
name = "slow"
handler = "testmodels:SlowEcho"
max_batch_size = {batch}
max_wait_ms = 1
max_queue = 1024
timeout_ms = 60000
[models.options]
delay_s = {delay_s}

[[tenants]]
name = "a"
[[tenants]]
name = "b"
[[tenants]]
name = "c"
weight = 3
[[tenants]]
name = "d"
[[tenants]]
name = "bulk"
[[tenants]]
name = "capped"
requests_per_s = {quota_rps}
"""


class Stream:
    """``clients`` closed-loop threads, each on its own keep-alive connection, POSTing to the slow model with
    ``headers``, ``pause_s`` between one answer and the next request; with ``honour_retry``, a 429 is followed by
    Retry-After seconds of waiting. Each answer kept as (finished at, latency s, status, Retry-After or None)."""

    def __init__(self, url: str, key: str, clients: int, priority: int | None = None, pause_s: float = 0.0,
                 honour_retry: bool = False) -> None:  # fmt: skip
        self.host, port = url.removeprefix("http://").rsplit(":", 1)
        self.port = int(port)
        self.headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
        if priority is not None:
            self.headers["X-Zserve-Priority"] = str(priority)
        self.pause_s = pause_s
        self.honour_retry = honour_retry
        self.records: list[tuple[float, float, int, str | None]] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(clients)]
        for t in self.threads:
            t.start()

    def _run(self, k: int) -> None:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        n = 0
        while not self.stop.is_set():
            n += 1
            started = time.monotonic()
            retry_after = None
            try:
                conn.request("POST", "/v1/models/slow/predict", json.dumps({"k": k, "n": n}), self.headers)
                resp = conn.getresponse()
                resp.read()
                status, retry_after = resp.status, resp.getheader("Retry-After")
            except (OSError, http.client.HTTPException):
                status = 0  # closed without an answer
                conn.close()
                conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
            ended = time.monotonic()
            self.records.append((ended, ended - started, status, retry_after))
            wait = self.pause_s
            if status == 429 and self.honour_retry:
                wait = max(wait, float(retry_after or 1))
            if wait:
                self.stop.wait(wait)
        conn.close()

    def window(self, start: float, end: float) -> dict[str, Any]:
        rows = [r for r in list(self.records) if start <= r[0] < end]
        ok = [r[1] for r in rows if r[2] == 200]
        seconds = end - start
        return {
            "statuses": dict(Counter(r[2] for r in rows)),
            "ok_per_s": round(len(ok) / seconds, 2),
            "p50_ms": percentile_ms(ok, 0.50),
            "p99_ms": percentile_ms(ok, 0.99),
            "429_without_retry_after": sum(1 for r in rows if r[2] == 429 and not r[3]),
        }

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=70)


def measure_window(streams: dict[str, Stream], warmup_s: float, seconds: float) -> dict[str, dict[str, Any]]:
    time.sleep(warmup_s)
    start = time.monotonic()
    time.sleep(seconds)
    end = time.monotonic()
    out = {name: s.window(start, end) for name, s in streams.items()}
    for s in streams.values():
        s.close()
    return out


def fair_phase(url: str, heavy: str, light: str, args: argparse.Namespace) -> dict[str, Any]:
    streams = {heavy: Stream(url, KEYS[heavy], 10 * args.light_clients),
               light: Stream(url, KEYS[light], args.light_clients)}  # fmt: skip
    got = measure_window(streams, args.warmup_s, args.phase_s)
    total = sum(w["ok_per_s"] for w in got.values())
    for w in got.values():
        w["share"] = round(w["ok_per_s"] / total, 3) if total else None
    return got


def priority_phase(url: str, args: argparse.Namespace) -> dict[str, Any]:
    in_engine = 2 * args.batch  # the engine's credits (2) x a batch: busy, nothing queued
    runs = {
        "floor": (in_engine, 0),  # the engine equally busy, nothing waiting: what priority can at best give
        "no_priorities": (in_engine + 5 * args.batch, 0),
        "urgent": (in_engine + 5 * args.batch, -10),
    }
    out = {}
    for name, (bulk_clients, priority) in runs.items():
        streams = {"bulk": Stream(url, KEYS["bulk"], bulk_clients, priority=0),
                   "sparse": Stream(url, KEYS["bulk"], 1, priority=priority, pause_s=args.sparse_pause_s)}  # fmt: skip
        out[name] = measure_window(streams, args.warmup_s, args.phase_s)
    return out


def quota_phase(url: str, args: argparse.Namespace) -> dict[str, Any]:
    alone = measure_window({"b": Stream(url, KEYS["b"], 2, pause_s=0.05)}, args.warmup_s, args.phase_s)
    # Offered 3x the quota, open loop-ish: clients pausing so that together they send about 3 x quota_rps.
    clients = 6
    pause_s = clients / (3 * args.quota_rps)
    # The same admitted load without the refused excess: what b's latency should be compared with.
    at_quota = measure_window({"capped": Stream(url, KEYS["capped"], clients, pause_s=clients / args.quota_rps),
                               "b": Stream(url, KEYS["b"], 2, pause_s=0.05)}, args.warmup_s, args.phase_s)  # fmt: skip
    time.sleep(1.5)  # the bucket refills
    flooded = measure_window({"capped": Stream(url, KEYS["capped"], clients, pause_s=pause_s),
                              "b": Stream(url, KEYS["b"], 2, pause_s=0.05)}, args.warmup_s, args.phase_s)  # fmt: skip
    time.sleep(1.5)  # the bucket refills
    honouring = measure_window({"capped": Stream(url, KEYS["capped"], 1, honour_retry=True)}, 0.0, args.phase_s)
    return {"b_alone": alone["b"], "at_quota": at_quota, "flooded": flooded,
            "honouring_retry_after": honouring["capped"], "quota_rps": args.quota_rps}  # fmt: skip


def environment() -> dict[str, Any]:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())  # fmt: skip
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit.stdout.strip(),
            "cpu": cpu, "cpus": os.cpu_count()}  # fmt: skip


def flood_phase(seconds: float) -> dict[str, Any]:
    """Open-loop floods on the broker core (engine 200/s, max_queue 100): what each tenant is served."""
    return {
        "before_10x": flood({"a": 1000, "b": 100}, seconds=seconds, make_room=False),
        "after_10x": flood({"a": 1000, "b": 100}, seconds=seconds),
        "both_past_share_1_1": flood({"a": 2000, "b": 200}, seconds=seconds),
        "both_past_share_1_3": flood({"a": 2000, "b": 200}, seconds=seconds, weights={"b": 3}),
        "admission_cost_us": admission_cost_us(),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"environment": environment(), "engine_capacity_per_s": args.batch / args.delay_s}
    if "flood" in args.phases:
        result["flood"] = flood_phase(args.flood_s)
        print(json.dumps({"flood": result["flood"]}), flush=True)
    if not set(args.phases) - {"flood"}:
        return result
    with tempfile.TemporaryDirectory(prefix="zserve-qos-") as tmp_name:
        tmp = Path(tmp_name)
        keys = tmp / "api_keys"
        keys.write_text("".join(f"{key} tenant={name}{' max_priority=-10' if name == 'bulk' else ''}\n"
                                for name, key in KEYS.items()))  # fmt: skip
        config = tmp / "qos.toml"
        config.write_text(CONFIG.format(port=free_tcp_port(), keys=keys, batch=args.batch, delay_s=args.delay_s,
                                        quota_rps=args.quota_rps))  # fmt: skip
        env = dict(os.environ, PYTHONPATH=str(REPO / "tests" / "support"))
        managed, url = zserve_up(config, startup_timeout_s=120, env=env)
        try:
            if "fair" in args.phases:
                result["fair_1_1"] = fair_phase(url, "a", "b", args)
                print(json.dumps({"fair_1_1": result["fair_1_1"]}), flush=True)
                result["fair_3_1"] = fair_phase(url, "d", "c", args)  # the heavy sender has the small weight
                print(json.dumps({"fair_3_1": result["fair_3_1"]}), flush=True)
            if "priority" in args.phases:
                result["priority"] = priority_phase(url, args)
                print(json.dumps({"priority": result["priority"]}), flush=True)
            if "quota" in args.phases:
                result["quota"] = quota_phase(url, args)
                print(json.dumps({"quota": result["quota"]}), flush=True)
        finally:
            managed.close()
    return result


def summary(r: dict[str, Any]) -> list[str]:
    lines = []
    for key, weights in (("fair_1_1", "1:1"), ("fair_3_1", "3:1")):
        if key in r:
            shares = ", ".join(f"{name} {w['share']}" for name, w in r[key].items())
            lines.append(f"fair share {weights}, 10x clients on the first: shares {shares}")
    if "priority" in r:
        p = r["priority"]
        lines.append(
            f"priority: sparse p50/p99 ms floor {p['floor']['sparse']['p50_ms']}/{p['floor']['sparse']['p99_ms']}, "
            f"no priorities {p['no_priorities']['sparse']['p50_ms']}/{p['no_priorities']['sparse']['p99_ms']}, "
            f"urgent {p['urgent']['sparse']['p50_ms']}/{p['urgent']['sparse']['p99_ms']}; "
            f"bulk p50 {p['urgent']['bulk']['p50_ms']}"
        )
    if "quota" in r:
        q = r["quota"]
        f = q["flooded"]
        lines.append(
            f"quota {q['quota_rps']}/s offered 3x: {f['capped']['ok_per_s']} 200/s, "
            f"statuses {f['capped']['statuses']}, "
            f"429s without Retry-After {f['capped']['429_without_retry_after']}; b p50 {f['b']['p50_ms']} ms vs "
            f"{q['at_quota']['b']['p50_ms']} with capped at its quota, {q['b_alone']['p50_ms']} alone; "
            f"honouring Retry-After: {q['honouring_retry_after']['statuses']}"
        )
    if "flood" in r:
        for key, run in r["flood"].items():
            if key == "admission_cost_us":
                lines.append(f"flood: us per arrival at a full queue {run}")
                continue
            tenants = ", ".join(
                f"{name} {t['offered']} offered, {t.get('ok', 0)} served ({t['share']}), {t.get('overloaded', 0)} "
                f"refused, {t.get('pushed_out', 0)} pushed out"
                for name, t in run["tenants"].items()
            )
            lines.append(f"flood {key}: {tenants}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phases", nargs="+", default=["fair", "priority", "quota", "flood"],
                   choices=["fair", "priority", "quota", "flood"])  # fmt: skip
    p.add_argument("--flood-s", type=float, default=20.0, help="simulated seconds of each flood (pure core)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--delay-s", type=float, default=0.04, help="per batch: capacity = batch / delay_s")
    p.add_argument("--light-clients", type=int, default=12, help="the light tenant's clients (the heavy: 10x)")
    p.add_argument("--sparse-pause-s", type=float, default=0.1)
    p.add_argument("--quota-rps", type=float, default=10.0)
    p.add_argument("--phase-s", type=float, default=15.0)
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument("--out", type=Path, help="write the JSON result here")
    args = p.parse_args(argv)
    result = measure(args)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    for line in summary(result):
        print(line)
    return 0

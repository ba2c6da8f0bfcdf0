"""Closed-loop load: wrk for HTTP (with a Lua script that reports JSON), and C coroutines on one AsyncClient
for the direct path."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench.common.measure import DIRECT, Measurement, percentile
from zserve.client import AsyncClient
from zserve.errors import ZserveError

WRK_TIMEOUT_S = 30  # wrk's own per-request timeout (its default of 2 s is shorter than a queue of 64 embeddings)
_MARK = "BENCH_JSON "

# wrk calls done() once, with every thread's statistics merged; latency is in microseconds.
_LUA = """\
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [==[%(body)s]==]

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '%(mark)s{"requests": %%d, "duration_us": %%d, "bytes": %%d, "p50_us": %%.1f, "p90_us": %%.1f, "p99_us": %%.1f, '
    .. '"max_us": %%.1f, "mean_us": %%.1f, "errors": {"connect": %%d, "read": %%d, "write": %%d, "status": %%d, '
    .. '"timeout": %%d}}\\n',
    summary.requests, summary.duration, summary.bytes, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.max, latency.mean, e.connect, e.read, e.write, e.status, e.timeout))
end
"""


class LoadError(RuntimeError):
    pass


def wrk_path() -> str | None:
    return shutil.which("wrk")


def wrk_version() -> str:
    out = subprocess.run(["wrk", "--version"], capture_output=True, text=True, check=False)
    match = re.search(r"wrk \S+", out.stdout + out.stderr)
    return match.group(0) if match else "wrk (unknown version)"


def write_lua(path: Path, body: bytes) -> Path:
    text = body.decode()
    if "]==]" in text:
        raise ValueError("the request body contains ']==]', which ends the Lua long string")
    path.write_text(_LUA % {"body": text, "mark": _MARK})
    return path


def check_endpoint(url: str, body: bytes) -> dict[str, Any]:
    """One POST before any load: it must answer 200 with JSON, or the numbers would measure errors."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.request("POST", parts.path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    if resp.status != 200:
        raise LoadError(f"POST {url} answered {resp.status}: {data[:300]!r}")
    return {"status": resp.status, "response_bytes": len(data), "headers": dict(resp.getheaders())}


def run_wrk(url: str, lua: Path, concurrency: int, duration_s: float) -> dict[str, Any]:
    """``wrk -t1 -cC -dDs --latency -s lua URL``; the JSON line its done() printed."""
    argv = [
        "wrk",
        "-t1",
        f"-c{concurrency}",
        f"-d{max(1, round(duration_s))}s",
        "--latency",
        f"--timeout={WRK_TIMEOUT_S}s",
        "-s",
        str(lua),
        url,
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=duration_s + WRK_TIMEOUT_S + 30, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith(_MARK):
            stats = json.loads(line[len(_MARK) :])
            if stats["duration_us"] < 0.8e6 * max(1, round(duration_s)):  # wrk stops early only when interrupted
                raise LoadError(
                    f"wrk stopped after {stats['duration_us'] / 1e6:.1f}s of {duration_s:g}s (interrupted?)"
                )
            return stats
    raise LoadError(f"{' '.join(argv)} exited {proc.returncode} without a result:\n{proc.stdout}\n{proc.stderr}")


def wrk_measurement(scenario: str, model: str, concurrency: int, stats: dict[str, Any]) -> Measurement:
    duration_s = stats["duration_us"] / 1e6
    errors = sum(stats["errors"].values())
    ok = stats["requests"] - stats["errors"]["status"]  # non-2xx answers are counted in requests too
    return Measurement(
        scenario=scenario,
        model=model,
        concurrency=concurrency,
        qps=ok / duration_s if duration_s > 0 else 0.0,
        p50_ms=stats["p50_us"] / 1000.0,
        p99_ms=stats["p99_us"] / 1000.0,
        requests=stats["requests"],
        errors=errors,
        duration_s=duration_s,
        detail={"wrk": stats},
    )


def measure_http(
    scenario: str, model: str, url: str, lua: Path, concurrency: int, duration_s: float, warmup_s: float
) -> Measurement:
    if warmup_s > 0:
        run_wrk(url, lua, concurrency, warmup_s)
    return wrk_measurement(scenario, model, concurrency, run_wrk(url, lua, concurrency, duration_s))


# ---- the direct client ----


async def _closed_loop(
    client: AsyncClient, model: str, body: Any, concurrency: int, duration_s: float
) -> tuple[list[float], list[int], list[float], int, float]:
    latencies: list[float] = []
    batch_sizes: list[int] = []
    queue_ms: list[float] = []
    errors = 0
    started = time.perf_counter()
    deadline = started + duration_s

    async def one_user() -> None:
        nonlocal errors
        while (t0 := time.perf_counter()) < deadline:
            try:
                answer = await client.infer(model, body)
            except ZserveError:
                errors += 1
                continue
            latencies.append(time.perf_counter() - t0)
            batch_sizes.append(answer.batch_size)
            queue_ms.append(answer.queue_ms)

    await asyncio.gather(*(one_user() for _ in range(concurrency)))
    return latencies, batch_sizes, queue_ms, errors, time.perf_counter() - started


async def _direct(
    config_path: Path,
    model: str,
    body: Any,
    concurrency: int,
    duration_s: float,
    warmup_s: float,
    before_measuring: Callable[[], None],
) -> Measurement:
    async with AsyncClient.from_config(config_path) as client:
        if warmup_s > 0:
            await _closed_loop(client, model, body, concurrency, warmup_s)
        before_measuring()
        latencies, batch_sizes, queue_ms, errors, elapsed = await _closed_loop(
            client, model, body, concurrency, duration_s
        )
    latencies.sort()
    n = len(latencies)
    return Measurement(
        scenario=DIRECT,
        model=model,
        concurrency=concurrency,
        qps=n / elapsed if elapsed > 0 else 0.0,
        p50_ms=percentile(latencies, 50) * 1000.0,
        p99_ms=percentile(latencies, 99) * 1000.0,
        requests=n + errors,
        errors=errors,
        duration_s=elapsed,
        detail={
            "mean_batch_size": sum(batch_sizes) / n if n else None,
            "mean_queue_ms": sum(queue_ms) / n if n else None,
        },
    )


def measure_direct(
    config_path: Path,
    model: str,
    body: Any,
    concurrency: int,
    duration_s: float,
    warmup_s: float,
    before_measuring: Callable[[], None] = lambda: None,
) -> Measurement:
    """C concurrent coroutines on one AsyncClient in this process, each sending its next request as soon as the
    last one is answered (uvloop, as the frontends use, when it is installed). ``before_measuring`` runs between
    the warm-up and the measured run."""
    coro = _direct(config_path, model, body, concurrency, duration_s, warmup_s, before_measuring)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def batch_size_totals(base_url: str, model: str) -> tuple[float, float] | None:
    """(sum, count) of the frontends' zserve_batch_size histogram for ``model``; None if /metrics lacks it.
    The difference across a run gives the mean batch size HTTP requests were computed in."""
    parts = urlsplit(base_url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode(errors="replace")
    except OSError:
        return None
    finally:
        conn.close()
    values = {}
    for kind in ("sum", "count"):
        match = re.search(rf'^zserve_batch_size_{kind}\{{[^}}]*model="{re.escape(model)}"[^}}]*\}} (\S+)$', text, re.M)
        if not match:
            return None
        values[kind] = float(match.group(1))
    return values["sum"], values["count"]

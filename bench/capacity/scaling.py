#!/usr/bin/env python
"""Scaling: throughput of 1, 2, 4, 8 engines with a simulated device, against linear, and the broker's CPU.

Each engine's ``predict`` sleeps ``base_ms + per_item_ms x batch`` (the device time of an accelerator whose
kernels do not need this host's CPU), so the figure measures what zserve adds: the broker's scheduling and
credits, the sockets, the direct client (coalesced: one Submits per IO-thread turn). Closed loop: the client
keeps ``window`` requests in flight (enough to fill every engine's credits with full batches), and the
throughput of N engines is compared with N x the throughput of one.

    .venv/bin/python -m bench.capacity --engines 1,2,4,8 --duration-s 6

Run it under ``flock /tmp/zserve-cpu.lock`` on a shared machine. Writes bench/results/scaling-DATE-TIME.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common.paths import RESULTS, with_repo_path
from zserve.model import Model


class SimulatedDevice(Model):
    """``predict`` sleeps like a device would: a fixed launch cost plus a cost per item."""

    def __init__(self, base_ms: float = 2.0, per_item_ms: float = 0.1) -> None:
        super().__init__(base_ms=base_ms, per_item_ms=per_item_ms)
        self.base_s, self.per_item_s = base_ms / 1000.0, per_item_ms / 1000.0

    def predict(self, batch: list[Any]) -> list[Any]:
        time.sleep(self.base_s + self.per_item_s * len(batch))
        return batch


def deployment_toml(run_dir: str, engines: int, args: argparse.Namespace) -> str:
    return f"""
[supervisor]
run_dir = "{run_dir}"
[[models]]
name = "sim"
handler = "bench.capacity.scaling:SimulatedDevice"
engines = {engines}
max_batch_size = {args.max_batch}
max_wait_ms = {args.max_wait_ms}
max_queue = 100000
credits = 2
[models.options]
base_ms = {args.base_ms}
per_item_ms = {args.per_item_ms}
"""


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def host_busy_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far (``/proc/stat``), to tell a saturated host."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle + iowait
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - idle) / hz, sum(ticks) / hz


def closed_loop(client: Any, window: int, duration_s: float) -> tuple[int, float]:
    """(answers, seconds) with ``window`` requests always in flight; a finished one is replaced at once."""
    done = [0]
    errors: list[BaseException] = []
    stop = threading.Event()
    finished = threading.Semaphore(0)

    def on_done(future: Any) -> None:
        if future.exception() is not None:
            errors.append(future.exception())
        done[0] += 1
        if stop.is_set():
            finished.release()
        else:
            client.submit("sim", 1).add_done_callback(on_done)

    for _ in range(window):
        client.submit("sim", 1).add_done_callback(on_done)
    time.sleep(duration_s)
    stop.set()
    for _ in range(window):
        finished.acquire(timeout=30)
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]!r}")
    return done[0], duration_s


def measure(engines: int, args: argparse.Namespace) -> dict[str, Any]:
    from zserve import Client
    from zserve.config import parse_config
    from zserve.deploy.plan import plan

    run_dir = tempfile.mkdtemp(prefix="zs-scale-")
    config = parse_config(deployment_toml(run_dir, engines, args))
    sup = plan(config, Path(run_dir) / "supervisor.toml")
    env_extra = {"PYTHONPATH": with_repo_path()["PYTHONPATH"]}  # the engines import SimulatedDevice from here
    procs = []
    for child in [sup.broker(), *[sup.engine(config.models[0], i) for i in range(engines)]]:
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        procs.append(subprocess.Popen(child.argv, env={**child.environ(dict(os.environ)), **env_extra}, **quiet))
    try:
        with Client(sup.endpoints.client, timeout_ms=60_000) as client:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if client.health(timeout_s=0.5).models[0].ready_workers >= engines:
                        break
                except Exception:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{engines} engines not ready")
                time.sleep(0.05)
            window = engines * args.max_batch * 2 * 2  # every credit holds a full batch, and as many queue
            closed_loop(client, window, args.warmup_s)
            pids = [p.pid for p in procs]
            before, wall_before, host_before = [cpu_s(pid) for pid in pids], time.monotonic(), host_busy_s()
            client_before = cpu_s(os.getpid())
            answers, seconds = closed_loop(client, window, args.duration_s)
            wall = time.monotonic() - wall_before
            cores = [(cpu_s(pid) - b) / wall for pid, b in zip(pids, before, strict=True)]
            client_cores = (cpu_s(os.getpid()) - client_before) / wall
            host_after = host_busy_s()
            host_busy = (host_after[0] - host_before[0]) / (host_after[1] - host_before[1])
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(run_dir, ignore_errors=True)
    batch_s = (args.base_ms + args.per_item_ms * args.max_batch) / 1000.0
    return {
        "engines": engines,
        "rps": answers / seconds,
        "device_limit_rps": engines * args.max_batch / batch_s,  # every engine always busy on full batches
        "broker_cores": cores[0],
        "broker_us_per_request": cores[0] * 1e6 / (answers / seconds),
        "engine_cores": sum(cores[1:]),  # all engine processes together
        "client_cores": client_cores,  # this process: the direct client and its IO thread
        "host_busy": host_busy,  # share of all the machine's cores busy during the run
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="1,2,4,8")
    parser.add_argument("--duration-s", type=float, default=6.0)
    parser.add_argument("--warmup-s", type=float, default=1.5)
    parser.add_argument("--base-ms", type=float, default=2.0, help="device time per batch (default 2)")
    parser.add_argument("--per-item-ms", type=float, default=0.1, help="device time per item (default 0.1)")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--max-wait-ms", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = [measure(int(n), args) for n in args.engines.split(",")]
    one = rows[0]["rps"] / rows[0]["engines"]
    columns = [("ENGINES", 7), ("REQ/S", 9), ("LINEAR", 9), ("VS_LINEAR", 9), ("DEVICE_LIMIT", 12)]
    print(
        " ".join(f"{name:>{width}}" for name, width in columns),
        f"{'BROKER_CORES':>12} {'BROKER_US/REQ':>13} {'ENGINE_CORES':>12} {'CLIENT_CORES':>12} {'HOST_BUSY':>9}",
    )
    for row in rows:
        row["linear_rps"] = one * row["engines"]
        row["vs_linear"] = row["rps"] / row["linear_rps"]
        print(
            f"{row['engines']:>7} {row['rps']:>9.0f} {row['linear_rps']:>9.0f} {row['vs_linear']:>9.3f} "
            f"{row['device_limit_rps']:>12.0f} {row['broker_cores']:>12.3f} {row['broker_us_per_request']:>13.1f} "
            f"{row['engine_cores']:>12.2f} {row['client_cores']:>12.2f} {row['host_busy']:>9.2f}"
        )
    out = args.out or RESULTS / f"scaling-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args) | {"out": str(out)}, "rows": rows, "cpus": os.cpu_count()}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

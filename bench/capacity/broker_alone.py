"""Broker capacity: how many items per second one broker process passes, and its CPU per item.

One real broker process (``python -m zserve.broker.broker``, the same command line the supervisor uses),
W no-op workers that answer every Batch at once with its own payload (an echo model with zero compute,
speaking the worker protocol directly so that they cost next to nothing), and C clients that replay
pre-encoded coalesced ``Submits`` of K items each, keeping ``window`` messages in flight. The clients are
raw sockets for the same reason: what is measured is the broker, not Python clients on the other core.
Every reply is checked (status OK, one payload frame per item).

    .venv/bin/python -m bench.capacity broker-alone [--workers 4] [--clients 2] [--items 256] [--window 4]
        [--seconds 8] [--json bench/results/broker-capacity.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import psutil
import zmq

from bench.common.paths import RESULTS
from zserve.frames import pack, unpack
from zserve.protocol import Batch, BatchResult, Codec, Heartbeat, Hello, Replies, Status, Submit, Submits

MODEL = "echo"


def noop_worker(work: str, out: str, name: str, credits: int) -> None:
    codec = Codec()
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, name.encode())
    dealer.connect(work)
    push = ctx.socket(zmq.PUSH)
    push.connect(out)
    dealer.send(codec.encode(Hello(name, os.getpid(), "engine", [MODEL], credits)))
    beat = codec.encode(Heartbeat(name))
    last_beat = 0.0
    while True:
        if time.monotonic() - last_beat > 0.1:
            push.send(beat)
            last_beat = time.monotonic()
        if not dealer.poll(100):
            continue
        frames = dealer.recv_multipart(copy=False)
        msg = codec.decode(frames[0].buffer)
        if isinstance(msg, Batch):
            n = len(msg.item_ids)
            result = BatchResult(msg.batch_id, name, [Status.OK] * n, [""] * n, [""] * n, msg.frame_counts)
            push.send_multipart([codec.encode(result), *frames[1:]], copy=False)  # the payload, still packed


def raw_client(endpoint: str, items: int, window: int, seconds: float, results: mp.Queue) -> None:
    codec = Codec()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    body = msgspec.msgpack.encode({"i": 1})
    wire = pack([body] * items)
    next_id = 0

    def send() -> None:
        nonlocal next_id
        header = Submits([Submit(next_id + i, MODEL) for i in range(items)], [1] * items)
        next_id += items
        sock.send_multipart([codec.encode(header), *wire])

    ok = bad = 0
    for _ in range(window):
        send()
    in_flight = window * items
    started = time.monotonic()
    while time.monotonic() - started < seconds and sock.poll(5000):
        frames = sock.recv_multipart(copy=False)
        msg = codec.decode(frames[0].buffer)
        if not isinstance(msg, Replies):
            continue
        payload = unpack(frames[1:])
        good = sum(1 for r in msg.items if r.status == Status.OK)
        if len(payload) != good:
            bad += len(msg.items)
        ok += good
        bad += len(msg.items) - good
        in_flight -= len(msg.items)
        while in_flight <= (window - 1) * items:
            send()
            in_flight += items
    results.put((ok, bad, time.monotonic() - started))


def measure(workers: int, clients: int, items: int, window: int, seconds: float) -> dict[str, Any]:
    """One run: the broker's items/s and CPU, with ``workers`` no-op workers and ``clients`` raw clients each
    keeping ``window`` Submits of ``items`` items in flight."""
    run_dir = Path(tempfile.mkdtemp(prefix="zs-cap-"))
    endpoints = {n: f"ipc://{run_dir}/{n}.sock" for n in ("client", "work", "out")}
    config = {
        "models": [{"name": MODEL, "handler": "x:Y", "max_batch_size": items, "max_wait_ms": 1.0, "max_queue": 1 << 20}]
    }
    broker = subprocess.Popen(
        [sys.executable, "-m", "zserve.broker.broker", "--config-json", json.dumps(config)]
        + [f"--{name}={endpoint}" for name, endpoint in endpoints.items()],
        stderr=subprocess.DEVNULL,
    )
    noop = [
        mp.Process(target=noop_worker, args=(endpoints["work"], endpoints["out"], f"noop-{i}", 4), daemon=True)
        for i in range(workers)
    ]
    results: mp.Queue = mp.Queue()
    loads = [
        mp.Process(target=raw_client, args=(endpoints["client"], items, window, seconds, results))
        for _ in range(clients)
    ]
    try:
        for w in noop:
            w.start()
        _wait_for_workers(endpoints["client"], workers)
        proc = psutil.Process(broker.pid)
        cpu0, t0 = sum(proc.cpu_times()[:2]), time.monotonic()
        for c in loads:
            c.start()
        outcomes = [results.get(timeout=seconds + 60) for _ in loads]
        cpu_s, wall_s = sum(proc.cpu_times()[:2]) - cpu0, time.monotonic() - t0
    finally:
        for p in noop + loads:
            p.terminate()
        broker.terminate()
        broker.wait()
        shutil.rmtree(run_dir, ignore_errors=True)
    ok = sum(o[0] for o in outcomes)
    return {
        "workers": workers,
        "clients": clients,
        "items_per_message": items,
        "window": window,
        "answered": ok,
        "items_per_s": sum(o[0] / o[2] for o in outcomes),
        "errors": sum(o[1] for o in outcomes),
        "seconds": seconds,
        "broker_cores": cpu_s / wall_s,
        "broker_us_per_item": cpu_s / max(ok, 1) * 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--items", type=int, default=256, help="items per Submits message")
    parser.add_argument("--window", type=int, default=4, help="messages in flight per client")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--json", default=str(RESULTS / "broker-capacity.json"))
    args = parser.parse_args(argv)
    row = measure(args.workers, args.clients, args.items, args.window, args.seconds) | {"git": _git()}
    print(
        f"broker capacity: {row['items_per_s']:,.0f} items/s ({row['answered']:,} answered, {row['errors']} errors), "
        f"broker CPU {row['broker_cores']:.2f} cores = {row['broker_us_per_item']:.2f} us/item; "
        f"{args.workers} no-op workers, {args.clients} clients x {args.window} messages of {args.items} items"
    )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(row, indent=2))
    return 0 if row["errors"] == 0 else 1


def _wait_for_workers(endpoint: str, n: int) -> None:
    from zserve import Client

    with Client(endpoint) as client:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                report = client.health(timeout_s=1.0)
                if report.models and report.models[0].ready_workers >= n:
                    return
            except Exception:
                pass
            time.sleep(0.05)
    raise TimeoutError(f"{n} workers did not register")


def _git() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


if __name__ == "__main__":
    sys.exit(main())

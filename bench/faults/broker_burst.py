"""Broker burst: does one huge request stall the broker? The real broker shell (``zserve.broker.broker.Broker``)
in a process of its own on real ipc sockets, two workers (DEALER + PUSH, as the worker runtime connects) that say
Hello and beat every ``--interval-ms``, and one client that sends ``--items`` requests at once (in Submits of 1024,
as ``zserve.Client`` splits them) for a model with no engine, so that its queue fills and the rest is refused
OVERLOADED: the broker's per-request work, without an engine's. Measured: the longest gap between the broker's
heartbeats as a worker saw them (the broker's stall, as its workers judge it: past ``interval x liveness`` they
register again, losing what they held), workers the broker declared lost (its log), and the time until every
request was answered.

    .venv/bin/python -m bench.faults.broker_burst --items 100000
    .venv/bin/python -m bench.faults.broker_burst --broker-file /tmp/old/broker/broker.py   # another version's shell
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import multiprocessing
import signal
import sys
import tempfile
import threading
import time
from typing import Any

import msgspec
import zmq

from zserve.client.sync import submits_messages
from zserve.config import Endpoints, parse_config
from zserve.protocol import Codec, Heartbeat, Hello, Replies, Reset, Submit

CONFIG = """
[broker]
heartbeat_interval_ms = {interval_ms}
heartbeat_liveness = {liveness}

[[models]]
name = "flooded"
handler = "x:Y"
max_queue = 1024

[[models]]
name = "served"
handler = "x:Y"
"""


class LostLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lost: list[str] = []
        self.slow: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if " lost: " in text:
            self.lost.append(text)
        elif "loop turn took" in text:
            self.slow.append(text)


def broker_class(path: str | None) -> Any:
    if path is None:
        from zserve.broker.broker import Broker

        return Broker
    spec = importlib.util.spec_from_file_location("zserve_broker_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.Broker


def worker(ctx: zmq.Context, ends: Endpoints, name: str, interval_s: float, stop: threading.Event,
           gaps: dict[str, float], resets: dict[str, int]) -> None:  # fmt: skip
    codec = Codec()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, name.encode())
    dealer.connect(ends.work)
    push = ctx.socket(zmq.PUSH)
    push.connect(ends.out)
    dealer.send(codec.encode(Hello(name, 0, "engine", ["served"], 2)))
    last_beat_s = next_send_s = time.monotonic()
    longest = 0.0
    while not stop.is_set():
        if dealer.poll(int(interval_s * 250)):
            for _ in range(1000):
                try:
                    frames = dealer.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = codec.decode(frames[0], "broker")
                if isinstance(msg, Heartbeat):
                    now = time.monotonic()
                    longest = max(longest, now - last_beat_s)
                    last_beat_s = now
                elif isinstance(msg, Reset):  # forgotten by the broker: register again, as a worker does
                    resets[name] = resets.get(name, 0) + 1
                    dealer.send(codec.encode(Hello(name, 0, "engine", ["served"], 2)))
        now = time.monotonic()
        if now >= next_send_s:
            push.send(codec.encode(Heartbeat(name)))
            next_send_s = now + interval_s
    gaps[name] = max(longest, time.monotonic() - last_beat_s)
    dealer.close(0)
    push.close(0)


def run_broker(config_toml: str, ends: Endpoints, broker_file: str | None, results: Any) -> None:
    """The broker in its own process, as ``zserve up`` runs it; SIGTERM stops it, and what its log said about
    lost workers and slow turns goes back through ``results``."""
    watch = LostLines()
    logging.getLogger("zserve.broker").addHandler(watch)
    broker = broker_class(broker_file)(parse_config(config_toml), ends)
    signal.signal(signal.SIGTERM, lambda *_: setattr(broker, "stopping", True))
    broker.run()
    results.put((watch.lost, watch.slow))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    config = CONFIG.format(interval_ms=args.interval_ms, liveness=args.liveness)
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    with tempfile.TemporaryDirectory(prefix="zserve-burst-") as tmp:
        ends = Endpoints(f"ipc://{tmp}/client", f"ipc://{tmp}/work", f"ipc://{tmp}/out")
        broker = spawn.Process(target=run_broker, args=(config, ends, args.broker_file, results), daemon=True)
        broker.start()
        codec = Codec()
        # built before the workers start timing: the burst is the broker's work, not this process's
        items = [(Submit(i + 1, "flooded", 60_000), [b"x"]) for i in range(args.items)]
        messages = submits_messages(codec, items)
        ctx = zmq.Context()
        stop, gaps, resets = threading.Event(), {}, {}
        interval_s = args.interval_ms / 1000.0
        workers = [
            threading.Thread(target=worker, args=(ctx, ends, f"w{i}", interval_s, stop, gaps, resets)) for i in range(2)
        ]
        for t in workers:
            t.start()
        time.sleep(1.0)  # registered and beating
        client = ctx.socket(zmq.DEALER)
        client.connect(ends.client)
        started = time.monotonic()
        for message in messages:
            client.send_multipart(message, copy=False)
        answered = 0
        while answered < args.items - 1024 and client.poll(30_000):
            msg = codec.decode(client.recv_multipart()[0], "broker")
            if isinstance(msg, Replies):
                answered += len(msg.items)
        answer_s = time.monotonic() - started
        time.sleep(3 * interval_s * args.liveness)  # long enough for a lost worker to be declared lost
        stop.set()
        for t in workers:
            t.join()
        broker.terminate()  # SIGTERM: the broker drains and stops
        lost, slow = results.get(timeout=60)
        broker.join(timeout=30)
        client.close(0)
        ctx.term()
    return {
        "items": args.items,
        "broker": args.broker_file or "this tree",
        "liveness_s": interval_s * args.liveness,
        "longest_heartbeat_gap_s": round(max(gaps.values()), 3),
        "refusals_answered_s": round(answer_s, 3),
        "workers_lost": len(lost),
        "worker_resets": sum(resets.values()),
        "slow_turn_lines": slow[:3],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--interval-ms", type=int, default=250)
    parser.add_argument("--liveness", type=int, default=4)
    parser.add_argument("--broker-file", help="broker.py of another version (e.g. a git worktree) to measure")
    args = parser.parse_args(argv)
    print(msgspec.json.encode(measure(args)).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The floor under every zserve hop: a bare pyzmq DEALER -> ROUTER -> DEALER round trip over ipc.

``python -m bench.serving.zmq_rtt --serve ENDPOINT`` is the echo ROUTER (a subprocess); ``measure`` is the DEALER
side, in the bench process: sequential round trips, default copy semantics, one small frame.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import zmq

from bench.common.measure import percentile
from bench.common.paths import with_repo_path
from bench.common.procs import Managed

WARMUP = 2_000


def serve(endpoint: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    print("ready", flush=True)
    while True:
        sock.send_multipart(sock.recv_multipart())


def measure(payload: bytes, duration_s: float = 2.0) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="zserve-bench-rtt-") as tmp:
        endpoint = f"ipc://{Path(tmp) / 'rtt.sock'}"
        with Managed(
            "zmq-echo",
            [sys.executable, "-m", "bench.serving.zmq_rtt", "--serve", endpoint],
            env=with_repo_path(),
            stop_timeout_s=5,
        ) as server:
            server.wait_for_line("^ready$", timeout_s=30)
            ctx = zmq.Context()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            try:
                for _ in range(WARMUP):
                    sock.send(payload)
                    sock.recv()
                samples: list[float] = []
                started = time.perf_counter()
                while time.perf_counter() - started < duration_s:
                    t0 = time.perf_counter()
                    sock.send(payload)
                    sock.recv()
                    samples.append(time.perf_counter() - t0)
            finally:
                sock.close()
                ctx.term()
    samples.sort()
    p50_us = percentile(samples, 50) * 1e6
    return {
        "round_trips": len(samples),
        "payload_bytes": len(payload),
        "rtt_p50_us": p50_us,
        "rtt_p99_us": percentile(samples, 99) * 1e6,
        "rtt_mean_us": sum(samples) / len(samples) * 1e6,
        "per_hop_us": p50_us / 2,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", metavar="ENDPOINT", required=True)
    serve(parser.parse_args().serve)

"""Abuse: what one caller's request costs everyone else (issue 40, findings 1 and 2). A ``zserve up`` deployment
with the default limits (echo, a tiny sentence-transformers embedder, the tiny Llama of tests/support with
``max_queue`` 256 and ``max_running`` 8) and normal traffic running: ``--clients`` closed-loop callers cycling an
echo predict, a one-input embedding and an 8-token completion. For each attack the others' p99 is measured for
``--calm-s`` without it, then for ``--after-s`` from the moment it is sent:

- ``prompts``: one /v1/completions with 300 prompts of ``--max-tokens`` each (finding 1: the broker took 256 and
  the caller got 503, while the 256 generations ran on for nobody);
- ``inputs``: one /v1/embeddings with 100k inputs (finding 2: the broker blocked past the liveness period and
  dropped every worker).

Also counted: the broker's "lost: no heartbeat" lines, /readyz answers other than 200 (polled every 100 ms), the
attacker's answer. ``PYTHONPATH`` decides which code runs, so the same script measures an older commit (a git
worktree, mapped in by a sitecustomize) side by side.

    .venv/bin/python -m bench.faults abuse
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common.paths import REPO
from bench.common.procs import zserve_up
from zserve.transport import free_tcp_port

CONFIG = """
[frontends]
workers = 1
port = {port}

[[models]]
name = "echo"
handler = "testmodels:SlowEcho"
max_batch_size = 8
max_wait_ms = 1
[models.options]
delay_s = 0.001

[[models]]
name = "emb"
handler = "zserve.models.embedding:SentenceEmbedding"
max_batch_size = 16
credits = 1
preprocess_workers = 1
[models.options]
path = "{emb}"

[[models]]
name = "tiny"
handler = "zserve.models.causal_lm:CausalLM"
max_queue = 256
timeout_ms = 300000
[models.options]
path = "{lm}"
block_size = 8
num_blocks = 1024
max_running = 8
"""


def post(url: str, path: str, body: dict, timeout_s: float = 300.0) -> tuple[int, Any]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    except (OSError, http.client.HTTPException) as exc:
        return 0, str(exc)
    finally:
        conn.close()


class Traffic:
    """The normal callers; each answer recorded as (ended at, latency s, route, status)."""

    ROUTES = (
        ("echo", "/v1/models/echo/predict", lambda k, n: {"i": f"{k}-{n}"}),
        ("embeddings", "/v1/embeddings", lambda k, n: {"model": "emb", "input": f"caller {k} sentence {n}"}),
        ("completion", "/v1/completions", lambda k, n: {"model": "tiny", "prompt": f"hello {n}", "max_tokens": 8}),
    )

    def __init__(self, url: str, clients: int) -> None:
        self.url = url
        self.done: list[tuple[float, float, str, int]] = []
        self.pending: dict[int, tuple[float, str]] = {}  # thread -> (started at, route) of what it waits for
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(clients)]
        for t in self.threads:
            t.start()

    def _run(self, k: int) -> None:
        n = k
        while not self.stop.is_set():
            n += 1
            route, path, body = self.ROUTES[n % len(self.ROUTES)]
            started = time.monotonic()
            self.pending[k] = (started, route)
            status, _ = post(self.url, path, body(k, n))
            ended = time.monotonic()
            del self.pending[k]
            self.done.append((ended, ended - started, route, status))

    def window(self, start: float, end: float) -> dict[str, Any]:
        """Latencies of the requests answered in [start, end), and of those still waiting at ``end`` counted as
        ``end - started`` (a caller stuck behind the attack has no answer to time, and must still count)."""
        rows = [r for r in list(self.done) if start <= r[0] < end]
        out: dict[str, Any] = {"answers": len(rows), "not_200": sum(1 for r in rows if r[3] != 200)}
        if end >= time.monotonic() - 0.01:  # measured right at the window's end: what is pending waited this long
            waiting = [(end, end - started, route, 0) for started, route in list(self.pending.values())]
            out["waiting_at_end"] = len(waiting)
            rows += [r for r in waiting if r[1] > 0]
        for route in [None, *(r[0] for r in self.ROUTES)]:
            lat = [r[1] for r in rows if route is None or r[2] == route]
            out[f"p99_ms_{route or 'all'}"] = round(float(np.percentile(lat, 99)) * 1000, 1) if lat else None
        return out

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=310)


def ready_watch(url: str, stop: threading.Event, bad: list[int]) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    while not stop.wait(0.1):
        try:
            conn = http.client.HTTPConnection(host, int(port), timeout=5)
            conn.request("GET", "/readyz")
            status = conn.getresponse().status
            conn.close()
        except (OSError, http.client.HTTPException):
            status = 0
        if status != 200:
            bad.append(status)


def prompts_attack(tokens: int) -> tuple[str, dict]:
    prompts = [f"prompt {i}" for i in range(300)]
    return "/v1/completions", {"model": "tiny", "prompt": prompts, "max_tokens": tokens, "ignore_eos": True}


def inputs_attack(tokens: int) -> tuple[str, dict]:
    return "/v1/embeddings", {"model": "emb", "input": ["a"] * 100_000}


ATTACKS = {"prompts": prompts_attack, "inputs": inputs_attack}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(REPO / "tests" / "support"))
    from st_stacks import build_bert_encoder, build_stack
    from tinylm import build_tiny_lm

    results: dict[str, Any] = {"code": os.environ.get("PYTHONPATH", "this tree"), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="zserve-abuse-") as tmp_name:
        tmp = Path(tmp_name)
        lm = build_tiny_lm(tmp / "tinylm")
        emb = build_stack(build_bert_encoder(tmp / "bert"), tmp / "emb", "mean")
        config = tmp / "abuse.toml"
        config.write_text(CONFIG.format(port=free_tcp_port(), emb=emb, lm=lm))
        support = str(REPO / "tests" / "support")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), support])))
        managed, url = zserve_up(config, startup_timeout_s=300, env=env)
        try:
            traffic = Traffic(url, args.clients)
            stop, bad = threading.Event(), []
            watcher = threading.Thread(target=ready_watch, args=(url, stop, bad), daemon=True)
            watcher.start()
            time.sleep(2.0)  # warm: connections, first batches
            for name in args.attacks:
                calm_start = time.monotonic()
                time.sleep(args.calm_s)
                attacked_at = time.monotonic()
                lost_before = sum(" lost: no heartbeat" in line for line in managed.notable)
                bad_before = len(bad)
                path, body = ATTACKS[name](args.max_tokens)
                status, answer = post(url, path, body)
                answered_s = time.monotonic() - attacked_at
                time.sleep(max(0.0, args.after_s - answered_s))
                end = time.monotonic()
                error = answer.get("error", {}) if isinstance(answer, dict) else {}
                results[name] = {
                    "attacker": {"status": status, "param": error.get("param"), "seconds": round(answered_s, 2)},
                    "attacked": traffic.window(attacked_at, end),
                    "calm": traffic.window(calm_start, attacked_at),
                    "workers_lost": sum(" lost: no heartbeat" in line for line in managed.notable) - lost_before,
                    "readyz_not_200": len(bad) - bad_before,
                }
                print(json.dumps({name: results[name]}), flush=True)
            stop.set()
            traffic.close()
        finally:
            managed.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=list(ATTACKS))
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--calm-s", type=float, default=6.0)
    parser.add_argument("--after-s", type=float, default=15.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, help="write the JSON result here")
    args = parser.parse_args(argv)
    results = measure(args)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

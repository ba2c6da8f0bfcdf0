"""Overload: goodput at 10x capacity. A ``zserve up`` deployment of SlowEcho (bench/faults/slow_echo.py: each batch
of up to ``--batch`` items sleeps ``--delay-s``, a fixed simulated device cost) behind gunicorn;
(1) capacity: a closed loop of ``--capacity-clients`` HTTP clients (enough to keep every engine's credits
full); (2) overload: ``--factor`` x as many clients for ``--duration-s`` (a closed loop whose 503s are
retried at once, so the offered load is far past capacity). Goodput = 200 answers/s in (2); the ratio to
(1) must be >= 0.9, and the RSS of every zserve process (supervisor, broker, engines, frontends) may grow
< 10% over (2). Prints a JSON result and a one-line summary.

    flock /tmp/zserve-cpu.lock .venv/bin/python -m bench.faults --duration-s 30
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from bench.faults.slow_echo import deploy, rss_mb, run_phase


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="zserve-overload-") as tmp:
        managed, url = deploy(Path(tmp), args.engines, args.batch, args.delay_s, args.max_queue, args.port)
        try:
            pid = managed.proc.pid
            capacity = run_phase(url, args.capacity_clients, args.warmup_s, args.capacity_s)
            rss_before = rss_mb(pid)
            overload = run_phase(url, args.capacity_clients * args.factor, args.warmup_s, args.duration_s)
            rss_after = rss_mb(pid)
        finally:
            notable = managed.close()
    ratio = overload["ok_per_s"] / capacity["ok_per_s"]
    growth = rss_after / rss_before - 1.0
    return {
        "device_limit_per_s": round(args.engines * args.batch / args.delay_s, 1),
        "capacity": capacity, "overload": overload, "goodput_ratio": round(ratio, 3),
        "rss_mb_before": round(rss_before, 1), "rss_mb_after": round(rss_after, 1), "rss_growth": round(growth, 4),
        "ok": ratio >= args.min_goodput and growth < 0.10, "server_notable_lines": notable[:20],
    }  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--delay-s", type=float, default=0.02)
    p.add_argument("--max-queue", type=int, default=64)
    p.add_argument("--capacity-clients", type=int, default=32, help="closed loop that keeps the engines full")
    p.add_argument("--factor", type=int, default=10, help="overload clients = factor x capacity clients")
    p.add_argument("--capacity-s", type=float, default=10.0)
    p.add_argument("--duration-s", type=float, default=30.0, help="the overload phase")
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument("--min-goodput", type=float, default=0.9)
    p.add_argument("--port", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    result = measure(args)
    print(json.dumps(result, indent=2))
    c, o = result["capacity"], result["overload"]
    print(f"overload: capacity {c['ok_per_s']}/s at c{c['clients']}; at c{o['clients']} goodput {o['ok_per_s']}/s "
          f"= {result['goodput_ratio']:.2f}x capacity ({o['answers_per_s']}/s answered, {o['outcomes']}); RSS "
          f"{result['rss_mb_before']} -> {result['rss_mb_after']} MB ({result['rss_growth']:+.1%}); "
          f"{'OK' if result['ok'] else 'FAILED'}")  # fmt: skip
    raise SystemExit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()

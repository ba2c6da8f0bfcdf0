"""Soak: a long run at a steady fraction of capacity, looking for leaks and drift. A ``zserve up``
deployment of SlowEcho (bench/faults/slow_echo.py) behind gunicorn; (1) capacity: a closed loop of
``--capacity-clients`` for ``--capacity-s``; (2) soak: an open loop at ``--load`` x that capacity for
``--duration-s`` (default 30 min), sampled every ``--interval-s``: the summed RSS and open fds of every zserve
process (supervisor, broker, engines, gunicorn master and workers), 200s/s, p50/p99, every other outcome.
The first ``--warmup-s`` are not measured (caches, allocator pools, gunicorn's first requests).

Pass: RSS growth (last sample against the first) < 5%, p99 drift (the p99 of the last tenth of the run
against the first tenth) < 20%, and nothing but 200s. Writes ``bench/results/soak-DATE-TIME.json`` and, with
matplotlib (``make bench-env``), a ``.png`` next to it: RSS, fds and latency over time.

    flock /tmp/zserve-cpu.lock .venv-bench/bin/python -m bench.faults soak              # 30 min
    .venv/bin/python -m bench.faults soak --duration-s 120 --interval-s 10 --warmup-s 10  # a quick look
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common.paths import REPO, RESULTS
from bench.common.report import save_figure
from bench.faults.slow_echo import Load, deploy, open_fds, percentile_ms, rss_mb, run_phase, window


def sample(load: Load, pid: int, started: float, before: tuple, at: float) -> tuple[dict[str, Any], tuple]:
    after, now = load.snapshot(), time.monotonic()
    row = {"t_s": round(now - started, 1), "rss_mb": round(rss_mb(pid), 1), "open_fds": open_fds(pid),
           **window(load, before, after, now - at)}  # fmt: skip
    return row, after


def soak(url: str, pid: int, rate_per_s: float, args: argparse.Namespace) -> dict[str, Any]:
    load = Load(url, args.clients, rate_per_s).start()
    try:
        time.sleep(args.warmup_s)
        started = time.monotonic()
        before, at = load.snapshot(), started
        first_latency = before[1]
        samples = [{"t_s": 0.0, "rss_mb": round(rss_mb(pid), 1), "open_fds": open_fds(pid)}]
        while time.monotonic() - started < args.duration_s - 1e-3:
            time.sleep(min(args.interval_s, args.duration_s - (time.monotonic() - started)))
            row, before = sample(load, pid, started, before, at)
            at = time.monotonic()
            samples.append(row)
            print(f"  t={row['t_s']:7.1f}s RSS {row['rss_mb']} MB fds {row['open_fds']} {row['ok_per_s']}/s "
                  f"p50 {row['p50_ms']} p99 {row['p99_ms']} ms {row['outcomes']}", flush=True)  # fmt: skip
        elapsed = time.monotonic() - started
    finally:
        load.finish()
    measured = load.latencies[first_latency : before[1]]
    tenth = elapsed / 10
    t0 = measured[0][0] if measured else 0.0
    first = [d for t, d in measured if t - t0 < tenth]
    last = [d for t, d in measured if t - t0 >= elapsed - tenth]
    outcomes: dict[str, int] = {}
    for row in samples[1:]:
        for k, v in row["outcomes"].items():
            outcomes[k] = outcomes.get(k, 0) + v
    return {"samples": samples, "seconds": round(elapsed, 1), "outcomes": outcomes,
            "p99_first_tenth_ms": percentile_ms(first, 0.99),
            "p99_last_tenth_ms": percentile_ms(last, 0.99)}  # fmt: skip


def write_plot(path: Path, result: dict[str, Any]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = result["soak"]["samples"]
    minutes = [r["t_s"] / 60 for r in rows]
    fig, (mem, fds, lat) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    mem.plot(minutes, [r["rss_mb"] for r in rows], marker=".")
    mem.set_ylabel("RSS, all zserve processes (MB)")
    mem.set_ylim(bottom=0)
    fds.plot(minutes, [r["open_fds"] for r in rows], marker=".", color="tab:green")
    fds.set_ylabel("open fds")
    fds.set_ylim(bottom=0)
    timed = rows[1:]
    for key, label in (("p50_ms", "p50"), ("p99_ms", "p99")):
        lat.plot([r["t_s"] / 60 for r in timed], [r[key] for r in timed], marker=".", label=label)
    lat.set_ylabel("latency of 200s (ms)")
    lat.set_xlabel("minutes (after warm-up)")
    lat.set_ylim(bottom=0)
    lat.legend()
    s = result["soak"]
    fig.suptitle(f"zserve soak: {result['rate_per_s']}/s ({result['load']:.0%} of capacity), "
                 f"{s['seconds'] / 60:.0f} min, git {result['git']}")  # fmt: skip
    save_figure(fig, path)
    return True


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="zserve-soak-") as tmp:
        managed, url = deploy(Path(tmp), args.engines, args.batch, args.delay_s, args.max_queue, args.port)
        try:
            pid = managed.proc.pid
            capacity = run_phase(url, args.capacity_clients, 2.0, args.capacity_s)
            rate = round(args.load * capacity["ok_per_s"], 1)
            print(f"capacity {capacity['ok_per_s']}/s at c{args.capacity_clients}; soak at {rate}/s", flush=True)
            result = soak(url, pid, rate, args)
        finally:
            notable = managed.close()
    samples = result["samples"]
    growth = samples[-1]["rss_mb"] / samples[0]["rss_mb"] - 1.0
    p99a, p99b = result["p99_first_tenth_ms"], result["p99_last_tenth_ms"]
    drift = p99b / p99a - 1.0 if p99a and p99b else None
    only_ok = set(result["outcomes"]) <= {"200"}
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return {
        "git": git.stdout.strip(), "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device_limit_per_s": round(args.engines * args.batch / args.delay_s, 1), "capacity": capacity,
        "load": args.load, "rate_per_s": rate, "clients": args.clients, "soak": result,
        "rss_growth": round(growth, 4), "p99_drift": round(drift, 4) if drift is not None else None,
        "fds_first_last": [samples[0]["open_fds"], samples[-1]["open_fds"]],
        "ok": growth < args.max_rss_growth and drift is not None and drift < args.max_p99_drift and only_ok,
        "server_notable_lines": notable[:20],
    }  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=1800.0, help="the soak, after warm-up")
    p.add_argument("--interval-s", type=float, default=30.0, help="one sample per interval")
    p.add_argument("--warmup-s", type=float, default=60.0)
    p.add_argument("--load", type=float, default=0.8, help="offered rate as a share of measured capacity")
    p.add_argument("--clients", type=int, default=64, help="open-loop connections (the most in flight)")
    p.add_argument("--capacity-clients", type=int, default=32)
    p.add_argument("--capacity-s", type=float, default=10.0)
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--delay-s", type=float, default=0.02)
    p.add_argument("--max-queue", type=int, default=256)
    p.add_argument("--max-rss-growth", type=float, default=0.05)
    p.add_argument("--max-p99-drift", type=float, default=0.20)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="the JSON (the plot goes next to it as .png)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    out = args.out or RESULTS / f"soak-{datetime.now(UTC):%Y%m%d-%H%M%S}.json"
    result = measure(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plotted = write_plot(out.with_suffix(".png"), result)
    s = result["soak"]
    drift = "n/a" if result["p99_drift"] is None else f"{result['p99_drift']:+.1%}"
    print(f"soak: {s['seconds'] / 60:.1f} min at {result['rate_per_s']}/s ({result['load']:.0%} of "
          f"{result['capacity']['ok_per_s']}/s); RSS {s['samples'][0]['rss_mb']} -> {s['samples'][-1]['rss_mb']} MB "
          f"({result['rss_growth']:+.1%}); fds {result['fds_first_last'][0]} -> {result['fds_first_last'][1]}; p99 "
          f"{s['p99_first_tenth_ms']} -> {s['p99_last_tenth_ms']} ms ({drift}); outcomes "
          f"{s['outcomes']}; {'OK' if result['ok'] else 'FAILED'}")  # fmt: skip
    print(f"wrote {out}" + (f" and {out.with_suffix('.png')}" if plotted else " (no plot: matplotlib not installed)"))
    raise SystemExit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()

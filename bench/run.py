#!/usr/bin/env python
"""zserve benchmark: closed-loop load at several concurrencies against

* zserve-http    zserve over HTTP (wrk against the gunicorn frontends),
* zserve-direct  zserve through the direct client (C coroutines on one AsyncClient),
* naive-http     the same model in a plain falcon app under gunicorn, predict([item]) per request,
* in-process     the model's predict called directly on a full batch (the limit),

plus a bare pyzmq DEALER<->ROUTER round trip over ipc. Prints a table and the targets, writes JSON (and a
PNG plot when matplotlib is installed). See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import loadgen
import report
import targets
import zmq_rtt
from bench_paths import BENCH, REPO, RESULTS
from catalog import DEFAULT_CONFIG, ModelPlan, clean_env, deployment_toml, plan_models, thread_env
from measure import HTTP, INPROCESS, NAIVE, Measurement, add_ratios
from procs import Managed, ProcessError, Stopped, free_port, naive_up, stop_on_signals, zserve_up
from zserve.config import Config

ALL_SCENARIOS = ("rtt", "inprocess", "http", "direct", "naive")
ECHO_HANDLER = "zserve.models.echo:Echo"
EMBED_HANDLER = "zserve.models.embedding:SentenceEmbedding"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="zserve benchmark (see bench/README.md)")
    parser.add_argument("--duration-s", type=float, default=10.0, help="measured seconds per run (default %(default)s)")
    parser.add_argument(
        "--warmup-s", type=float, default=3.0, help="warm-up seconds before each run (default %(default)s)"
    )
    parser.add_argument("--concurrency", default="1,16,64", help="closed-loop concurrencies (default %(default)s)")
    parser.add_argument(
        "--models", default="echo,minilm", help="models of the deployment to test (default %(default)s)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads for every model's engines, the in-process limit and the naive "
        "workers (default: each model's `threads` in the config)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="gunicorn workers, zserve frontends and naive alike (default: [frontends] workers)",
    )
    parser.add_argument(
        "--scenarios",
        default=",".join(ALL_SCENARIOS),
        help="which to run, of " + ",".join(ALL_SCENARIOS) + " (default: all)",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=DEFAULT_CONFIG,
        help="the deployment to measure; port, run dir and threads are overridden (default: %(default)s)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="JSON output (default: bench/results/bench-DATE-TIME.json)"
    )
    parser.add_argument("--verbose", action="store_true", help="echo the servers' output")
    args = parser.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    args.models = [m for m in args.models.split(",") if m]
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = sorted(set(args.scenarios) - set(ALL_SCENARIOS))
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(ALL_SCENARIOS)}")
    if args.out is None:
        args.out = RESULTS / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    return args


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def git_revision() -> str:
    def git(*args: str) -> str:
        out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=False)
        return out.stdout.strip()

    rev = git("rev-parse", "--short", "HEAD") or "unknown"
    return rev + ("+dirty" if git("status", "--porcelain") else "")


def progress(m: Measurement, extra: str = "") -> None:
    where = f"b{m.batch}" if m.scenario == INPROCESS else f"c{m.concurrency}"
    errors = f"  {m.errors} errors" if m.errors else ""
    print(
        f"  {m.scenario:<14} {m.model:<8} {where:>4}  {m.qps:10.1f}/s  p50 {m.p50_ms:8.2f} ms  "
        f"p99 {m.p99_ms:8.2f} ms{errors}{extra}",
        flush=True,
    )


def measure_inprocess(config_path: Path, plan: ModelPlan, duration_s: float) -> Measurement:
    argv = [
        sys.executable,
        str(BENCH / "inprocess.py"),
        "--config",
        str(config_path),
        "--model",
        plan.name,
        "--body-json",
        json.dumps(plan.body),
        "--duration-s",
        str(duration_s),
    ]
    proc = subprocess.run(
        argv, capture_output=True, text=True, env=thread_env(plan.threads), timeout=duration_s + 600, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"in-process measurement of {plan.name} failed:\n{proc.stderr[-3000:]}")
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    return Measurement(
        scenario=INPROCESS,
        model=plan.name,
        concurrency=None,
        qps=stats["items_per_s"],
        p50_ms=stats["call_p50_ms"],
        p99_ms=stats["call_p99_ms"],
        requests=stats["items"],
        errors=0,
        duration_s=stats["elapsed_s"],
        batch=stats["batch"],
        detail=stats,
    )


def measure_http(
    server: Managed, base_url: str, scenario: str, plan: ModelPlan, lua: Path, c: int, args: argparse.Namespace
) -> Measurement:
    url = f"{base_url}/v1/models/{plan.name}/predict"
    server.wait_idle()
    if args.warmup_s > 0:
        loadgen.run_wrk(url, lua, c, args.warmup_s)
    idle_s = server.wait_idle()  # what the warm-up left queued must not count against the measured run
    before = loadgen.batch_size_totals(base_url, plan.name) if scenario == HTTP else None
    m = loadgen.wrk_measurement(scenario, plan.name, c, loadgen.run_wrk(url, lua, c, args.duration_s))
    after = loadgen.batch_size_totals(base_url, plan.name) if scenario == HTTP else None
    if before and after and after[1] > before[1]:
        m.detail["mean_batch_size"] = (after[0] - before[0]) / (after[1] - before[1])
    m.detail["idle_wait_s"] = idle_s
    return m


def run_zserve(
    config_path: Path,
    config: Config,
    plans: list[ModelPlan],
    work: Path,
    args: argparse.Namespace,
    results: list[Measurement],
    notes: dict[str, Any],
) -> None:
    print("starting zserve ...", flush=True)
    # The supervisor gives up after its own startup_timeout_s; wait a little longer than that for its verdict.
    wait_s = config.supervisor.startup_timeout_s + 30
    server, base_url = zserve_up(config_path, wait_s, echo=args.verbose, env=clean_env())
    try:
        print(f"zserve ready at {base_url}", flush=True)
        for plan in plans:
            lua = loadgen.write_lua(work / f"{plan.name}.lua", plan.body_bytes)
            if "http" in args.scenarios:
                loadgen.check_endpoint(f"{base_url}/v1/models/{plan.name}/predict", plan.body_bytes)
            for c in args.concurrency:
                if "http" in args.scenarios:
                    m = measure_http(server, base_url, HTTP, plan, lua, c, args)
                    results.append(m)
                    batch = m.detail.get("mean_batch_size")
                    progress(m, f"  (mean batch {batch:.1f})" if batch else "")
                if "direct" in args.scenarios:
                    server.wait_idle()
                    m = loadgen.measure_direct(config_path, plan.name, plan.body, c, args.duration_s, args.warmup_s)
                    results.append(m)
                    batch = m.detail.get("mean_batch_size")
                    progress(
                        m, f"  (mean batch {batch:.1f}, queue {m.detail['mean_queue_ms']:.2f} ms)" if batch else ""
                    )
    finally:
        print("stopping zserve ...", flush=True)
        strays = server.close()
        notes["zserve_exit_code"] = server.proc.returncode if server.proc else None
        notes["zserve_strays"] = strays
        notes["zserve_notable_lines"] = server.notable


def run_naive(
    config_path: Path,
    config: Config,
    plans: list[ModelPlan],
    work: Path,
    args: argparse.Namespace,
    results: list[Measurement],
    notes: dict[str, Any],
) -> None:
    threads = max(p.threads for p in plans)
    print(
        f"starting the naive baseline ({config.frontends.workers} gunicorn workers, {threads} torch threads each) ...",
        flush=True,
    )
    server, base_url = naive_up(
        config_path,
        [p.name for p in plans],
        free_port(),
        config.frontends.workers,
        threads,
        work / "naive-ready",
        echo=args.verbose,
    )
    try:
        for plan in plans:
            lua = loadgen.write_lua(work / f"{plan.name}.lua", plan.body_bytes)
            loadgen.check_endpoint(f"{base_url}/v1/models/{plan.name}/predict", plan.body_bytes)
            for c in args.concurrency:
                m = measure_http(server, base_url, NAIVE, plan, lua, c, args)
                results.append(m)
                progress(m)
    finally:
        print("stopping the naive baseline ...", flush=True)
        notes["naive_strays"] = server.close()
        notes["naive_notable_lines"] = server.notable


def header(config: Config, plans: list[ModelPlan], args: argparse.Namespace, wrk: str | None) -> dict[str, Any]:
    meta = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git": git_revision(),
        "host": platform.node(),
        "cpu_cores": cpu_count(),
        "python": platform.python_version(),
        "wrk": wrk,
        "torch_threads": {p.name: p.threads for p in plans},
        "frontend_workers": config.frontends.workers,
        "duration_s": args.duration_s,
        "warmup_s": args.warmup_s,
        "concurrency": args.concurrency,
        "scenarios": args.scenarios,
        "config": str(args.config),
        "models": {
            p.name: {
                "handler": p.config.handler,
                "max_batch_size": p.batch,
                "max_wait_ms": p.config.max_wait_ms,
                "engines": p.config.engines,
                "body": p.body,
            }
            for p in plans
        },
    }
    threads = ", ".join(f"{p.name}={p.threads}" for p in plans)
    print(f"zserve bench  {meta['date']}  git {meta['git']}  python {meta['python']}  {wrk or 'wrk not used'}")
    print(
        f"machine: {meta['cpu_cores']} CPU cores;  torch threads: {threads} (engines, in-process limit and naive "
        f"workers alike);  frontends: {config.frontends.workers} gunicorn workers (zserve and naive alike)"
    )
    print(
        f"runs: {args.duration_s:g}s measured after {args.warmup_s:g}s warm-up;  concurrency {args.concurrency};  "
        f"scenarios {','.join(args.scenarios)}",
        flush=True,
    )
    return meta


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_signals()
    wrk = None
    if {"http", "naive"} & set(args.scenarios):
        if loadgen.wrk_path() is None:
            print(
                "bench: `wrk` is not installed, and the HTTP scenarios need it.\n"
                "  Install it with `apt-get install -y wrk` (Debian/Ubuntu) or from https://github.com/wg/wrk,\n"
                "  or run only the other scenarios: --scenarios rtt,inprocess,direct",
                file=sys.stderr,
            )
            return 2
        wrk = loadgen.wrk_version()
    config, plans = plan_models(args.config, args.models, args.threads)
    if args.workers is not None:
        config.frontends.workers = args.workers
    meta = header(config, plans, args, wrk)

    results: list[Measurement] = []
    notes: dict[str, Any] = {}
    rtt: dict[str, float] | None = None
    interrupted = False
    failure: str | None = None
    with tempfile.TemporaryDirectory(prefix="zserve-bench-") as tmp:
        work = Path(tmp)
        config_path = work / "supervisor.toml"
        config_path.write_text(deployment_toml(config, free_port()))
        try:
            if "rtt" in args.scenarios:
                echo_body = next((p.body_bytes for p in plans if p.config.handler == ECHO_HANDLER), b'{"x":1}')
                rtt = zmq_rtt.measure(echo_body, duration_s=min(args.duration_s, 3.0))
                print(
                    f"  bare pyzmq DEALER<->ROUTER over ipc: round trip p50 {rtt['rtt_p50_us']:.1f} us, "
                    f"p99 {rtt['rtt_p99_us']:.1f} us -> {rtt['per_hop_us']:.1f} us per hop "
                    f"({rtt['round_trips']} sequential round trips, {rtt['payload_bytes']}-byte frame)",
                    flush=True,
                )
            if "inprocess" in args.scenarios:
                for plan in plans:
                    m = measure_inprocess(config_path, plan, args.duration_s)
                    results.append(m)
                    progress(m, f"  ({m.detail['calls']} calls, torch threads {m.detail['torch_threads']})")
            if {"http", "direct"} & set(args.scenarios):
                run_zserve(config_path, config, plans, work, args, results, notes)
            if "naive" in args.scenarios:
                run_naive(config_path, config, plans, work, args, results, notes)
        except (KeyboardInterrupt, Stopped) as exc:
            interrupted = True
            why = f"stopped by {exc}" if isinstance(exc, Stopped) else "interrupted"
            print(f"\nbench: {why}; every server is stopped; reporting what was measured", file=sys.stderr)
        except (ProcessError, loadgen.LoadError, RuntimeError) as exc:
            failure = str(exc)
            print(f"\nbench: FAILED: {failure}\nevery server is stopped; reporting what was measured", file=sys.stderr)

    add_ratios(results)
    echo = next((p.name for p in plans if p.config.handler == ECHO_HANDLER), "echo")
    embed = next((p.name for p in plans if p.config.handler == EMBED_HANDLER), "minilm")
    checked = targets.evaluate(results, rtt, echo=echo, embed=embed)
    print()
    print(report.format_table(results))
    print("x naive: QPS over naive-http's at the same model and concurrency; x limit: over the in-process limit's.")
    if rtt:
        print(f"bare zmq round trip (ipc): p50 {rtt['rtt_p50_us']:.1f} us = {rtt['per_hop_us']:.1f} us per hop")
    print()
    print(targets.format_targets(checked))
    for key in ("zserve_strays", "naive_strays"):
        if notes.get(key):
            print(f"WARNING {key}: {notes[key]}")
    lines = notes.get("zserve_notable_lines") or []
    if lines:
        print(f"zserve logged {len(lines)} warning/error line(s) during the run (in the JSON); first: {lines[0]}")

    document = {
        "meta": meta | {"interrupted": interrupted, "failure": failure},
        "zmq_round_trip": rtt,
        "results": [m.to_json() for m in results],
        "targets": [t.to_json() for t in checked],
        "notes": notes,
    }
    report.write_json(args.out, document)
    print(f"\nwrote {args.out}")
    plot = args.out.with_suffix(".png")
    if results and report.write_plot(plot, results):
        print(f"wrote {plot}")
    return 130 if interrupted else 1 if failure else 0


if __name__ == "__main__":
    sys.exit(main())

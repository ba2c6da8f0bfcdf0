#!/usr/bin/env python
"""zserve benchmark: closed-loop load at several concurrencies against

* zserve-http    zserve over HTTP (wrk against the gunicorn frontends),
* zserve-direct  zserve through the direct client (C coroutines on one AsyncClient),
* naive-http     the same model in a plain falcon app under gunicorn, predict([item]) per request,
* mosec-http     the same model behind mosec (Rust HTTP, Python workers, dynamic batching),
* streamer-http  the same model behind service-streamer's multiprocess Streamer (Flask under gevent),
* broker-capacity  no-op engines and direct clients with many requests in flight: items/s, broker CPU per item,
* broker-alone   the broker process with no-op workers and raw clients replaying coalesced Submits: its capacity,
* in-process     the model's predict called directly on a full batch (the limit),

plus a bare pyzmq DEALER<->ROUTER round trip over ipc. Prints a table and the targets, writes JSON (and a
PNG plot when matplotlib is installed). See bench/README.md.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from bench.common import loadgen, report
from bench.common.catalog import DEFAULT_CONFIG, ModelPlan, deployment_toml, plan_models
from bench.common.measure import Measurement, add_ratios
from bench.common.paths import RESULTS
from bench.common.procs import ProcessError, Stopped, free_port, stop_on_signals
from bench.common.report import git_revision
from bench.serving import scenarios, targets
from zserve.config import Config, usable_cores

ALL_SCENARIOS = scenarios.ALL


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
        "--peer-backend",
        default="",
        help="the embedders' `backend` option for the naive server and the peers only (e.g. torch, the library's "
        "own, where zserve's default auto may take ONNX Runtime); default: the deployment's, as zserve",
    )
    parser.add_argument(
        "--naive-threads",
        type=int,
        default=None,
        help="torch intra-op threads per naive worker (default: cores // workers, at least 1: the naive "
        "baseline's own best setting, each worker on its share of the cores)",
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
    parser.add_argument("--broker-engines", type=int, default=3, help="broker-capacity: no-op engines (default 3)")
    parser.add_argument("--broker-batch", type=int, default=256, help="broker-capacity: their max_batch_size (256)")
    parser.add_argument("--broker-clients", type=int, default=2, help="broker-capacity: client processes (default 2)")
    parser.add_argument(
        "--broker-window", type=int, default=512, help="broker-capacity: requests in flight per client (default 512)"
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


def peer_versions() -> dict[str, str | None]:
    """The installed version of each peer (None: not installed in this interpreter)."""
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for dist in ("mosec", "service-streamer", "gevent", "flask"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    return versions


def header(config: Config, plans: list[ModelPlan], args: argparse.Namespace, wrk: str | None) -> dict[str, Any]:
    meta = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git": git_revision(),
        "host": platform.node(),
        "cpu_cores": usable_cores(),
        "python": platform.python_version(),
        "wrk": wrk,
        "torch_threads": {p.name: p.threads for p in plans},
        "naive_torch_threads": args.naive_threads,
        "frontend_workers": config.frontends.workers,
        "duration_s": args.duration_s,
        "warmup_s": args.warmup_s,
        "concurrency": args.concurrency,
        "scenarios": args.scenarios,
        "peers": peer_versions(),
        "broker_capacity": {
            "engines": args.broker_engines,
            "max_batch_size": args.broker_batch,
            "clients": args.broker_clients,
            "window_per_client": args.broker_window,
        },
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
        f"machine: {meta['cpu_cores']} CPU cores;  torch threads: {threads} (zserve engines and the in-process "
        f"limit), {args.naive_threads} per naive worker;  frontends: {config.frontends.workers} gunicorn workers "
        "(zserve and naive alike)"
    )
    peers = ", ".join(f"{k} {v}" for k, v in meta["peers"].items() if v) or "none installed"
    print(
        f"peers: {peers}; each peer runs one model process per model with the same torch threads, max_batch_size "
        "and max_wait_ms as zserve's engines"
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
    if {scenarios.HTTP_KEY, scenarios.NAIVE_KEY, scenarios.MOSEC_KEY, scenarios.STREAMER_KEY} & set(args.scenarios):
        if loadgen.wrk_path() is None:
            print(
                "bench: `wrk` is not installed, and the HTTP scenarios need it.\n"
                "  Install it with `apt-get install -y wrk` (Debian/Ubuntu) or from https://github.com/wg/wrk,\n"
                "  or run only the other scenarios: --scenarios rtt,inprocess,direct,broker",
                file=sys.stderr,
            )
            return 2
        wrk = loadgen.wrk_version()
    config, plans = plan_models(args.config, args.models, args.threads)
    if args.workers is not None:
        config.frontends.workers = args.workers
    if args.naive_threads is None:
        args.naive_threads = max(1, usable_cores() // config.frontends.workers)
    meta = header(config, plans, args, wrk)

    interrupted, failure = False, None
    with tempfile.TemporaryDirectory(prefix="zserve-bench-") as tmp:
        config_path = Path(tmp) / "supervisor.toml"
        config_path.write_text(deployment_toml(config, free_port()))
        peer_config_path = config_path
        if args.peer_backend:
            peer_config_path = Path(tmp) / "peers.toml"
            peer_config_path.write_text(deployment_toml(peer_backend(config, args.peer_backend), free_port()))
            meta["peer_backend"] = args.peer_backend
            print(f"naive server and peers: embedders with backend = {args.peer_backend!r}", flush=True)
        session = scenarios.Session(config, config_path, plans, Path(tmp), args.concurrency, args.duration_s,
                                    args.warmup_s, args.scenarios, args.naive_threads, args.verbose,
                                    args.broker_engines, args.broker_batch, args.broker_clients,
                                    args.broker_window, peer_config_path=peer_config_path)  # fmt: skip
        try:
            scenarios.run_all(session)
        except (KeyboardInterrupt, Stopped) as exc:
            interrupted = True
            why = f"stopped by {exc}" if isinstance(exc, Stopped) else "interrupted"
            print(f"\nbench: {why}; every server is stopped; reporting what was measured", file=sys.stderr)
        except (ProcessError, loadgen.LoadError, RuntimeError) as exc:
            failure = str(exc)
            print(f"\nbench: FAILED: {failure}\nevery server is stopped; reporting what was measured", file=sys.stderr)

    results, rtt, notes = session.results, session.rtt, session.notes
    add_ratios(results)
    echo = next((p.name for p in plans if p.config.handler == scenarios.ECHO_HANDLER), "echo")
    embed = next((p.name for p in plans if p.config.handler == scenarios.EMBED_HANDLER), "minilm")
    checked = targets.evaluate(results, rtt, echo=echo, embed=embed)
    document = {
        "meta": meta | {"interrupted": interrupted, "failure": failure},
        "zmq_round_trip": rtt,
        "results": [m.to_json() for m in results],
        "targets": [t.to_json() for t in checked],
        "notes": notes,
    }
    # Files first: a closed stdout (`| head`) must not lose the results.
    report.write_json(args.out, document)
    plot = args.out.with_suffix(".png")
    plotted = bool(results) and report.write_plot(plot, results)
    print_summary(results, rtt, checked, notes)
    print(f"\nwrote {args.out}" + (f" and {plot}" if plotted else ""))
    return 130 if interrupted else 1 if failure else 0


def peer_backend(config: Config, backend: str) -> Config:
    """``config`` with ``backend`` in every embedder's options."""
    models = [msgspec.structs.replace(m, options={**m.options, "backend": backend})
              if m.handler == scenarios.EMBED_HANDLER else m for m in config.models]  # fmt: skip
    return msgspec.structs.replace(config, models=models)


def print_summary(
    results: list[Measurement], rtt: dict[str, float] | None, checked: list[targets.Target], notes: dict[str, Any]
) -> None:
    print()
    print(report.format_table(results))
    print(
        "x naive, x mosec: QPS over naive-http's (mosec-http's) at the same model and concurrency; x limit: over the "
        "in-process limit's. broker-capacity: conc = requests in flight (clients x window)."
    )
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


if __name__ == "__main__":
    sys.exit(main())

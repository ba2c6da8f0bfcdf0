#!/usr/bin/env python
"""Per-hop profile: the CPU each zserve process spends per request, under closed-loop load.

Starts the bench's deployment (the same one bench/serving/run.py measures), then for each model and path (``http``:
wrk -> gunicorn frontends -> broker -> [stage] -> engine; ``direct``: AsyncClient in this process -> broker ->
...) runs a warm-up and a measured run, and reports for every process its CPU (psutil ``cpu_times`` deltas over
the measured run) in microseconds per answered request and in cores. With ``--py-spy`` each server process (and,
for the direct path, this process) is sampled during the measured run and the functions it spends its
non-idle samples in are summarised (``py-spy record --format raw --nonblocking``; py-spy's own sampling takes a
little CPU too, so run without it for the CPU figures that go into a table).

    .venv-bench/bin/python -m bench.serving hops --models echo,minilm --concurrency 64 --duration-s 8 --threads 1 \\
        --py-spy

Run it under ``flock /tmp/zserve-cpu.lock`` on a shared machine. Writes bench/results/hops-DATE-TIME.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import loadgen
from bench.common.catalog import DEFAULT_CONFIG, ModelPlan, clean_env, deployment_toml, plan_models
from bench.common.paths import RESULTS, VENV_BIN
from bench.common.procs import Managed, free_port, stop_on_signals, zserve_up

PATHS = ("http", "direct")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="echo,minilm", help="models of the deployment (default %(default)s)")
    parser.add_argument("--paths", default="http,direct", help="of http,direct (default %(default)s)")
    parser.add_argument("--concurrency", type=int, default=64, help="closed-loop concurrency (default 64)")
    parser.add_argument("--duration-s", type=float, default=8.0, help="measured seconds per run (default 8)")
    parser.add_argument("--warmup-s", type=float, default=2.0, help="warm-up seconds (default 2)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of the engines (default: config)")
    parser.add_argument("--workers", type=int, default=None, help="gunicorn workers (default: [frontends] workers)")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the deployment (default: %(default)s)")
    parser.add_argument("--py-spy", action="store_true", help="also sample every process with py-spy")
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second (default 100)")
    parser.add_argument("--top", type=int, default=8, help="functions listed per process role (default 8)")
    parser.add_argument("--out", type=Path, default=None, help="JSON (default bench/results/hops-DATE-TIME.json)")
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.paths = [p for p in args.paths.split(",") if p]
    if unknown := sorted(set(args.paths) - set(PATHS)):
        parser.error(f"unknown path(s) {', '.join(unknown)}; choose from {', '.join(PATHS)}")
    if args.out is None:
        args.out = RESULTS / f"hops-{time.strftime('%Y%m%d-%H%M%S')}.json"
    return args


# ---- py-spy ----


def py_spy() -> str | None:
    found = VENV_BIN / "py-spy"
    return str(found) if found.exists() else shutil.which("py-spy")


def start_py_spy(exe: str, pid: int, out: Path, duration_s: float, rate: int) -> subprocess.Popen[bytes]:
    argv = [exe, "record", "--pid", str(pid), "--format", "raw", "--output", str(out), "--rate", str(rate),
            "--duration", str(max(1, round(duration_s))), "--nonblocking"]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def summarise_raw(path: Path, top: int) -> dict[str, Any]:
    """A py-spy raw file (``frame;frame;...;leaf COUNT`` per line, root first) as the ``top`` functions by own
    (leaf) samples and by inclusive samples, each as a share of the non-idle samples."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            stack, _, count_text = line.rpartition(" ")
            if not stack or not count_text.isdigit():
                continue
            count = int(count_text)
            frames = [f for f in stack.split(";") if not f.startswith("process ") and not f.startswith("thread ")]
            if not frames:
                continue
            total += count
            own[frames[-1]] += count
            for frame in set(frames):
                inclusive[frame] += count

    def share(counter: collections.Counter[str]) -> list[tuple[str, float]]:
        return [(frame, 100.0 * n / total) for frame, n in counter.most_common() if n < 0.99 * total][:top]

    # Inclusive: frames under (nearly) every sample are the process's entry chain (runpy, main, serve loop)
    # and say nothing; the list starts below them.
    return {"samples": total, "own_pct": share(own), "inclusive_pct": share(inclusive)}


# ---- one measured run ----


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _names(before: dict[int, tuple[str, int, float]]) -> dict[int, str]:
    """A readable name per pid: its role, gunicorn's master told from its workers."""
    names = {}
    for pid, (role, ppid, _) in before.items():
        if role == "gunicorn":
            role = "gunicorn-worker" if before.get(ppid, ("",))[0] == "gunicorn" else "gunicorn-master"
        names[pid] = role
    return names


def profile_run(
    server: Managed, plan: ModelPlan, path: str, args: argparse.Namespace, base_url: str, config: Path, work: Path
) -> dict[str, Any]:
    url = f"{base_url}/v1/models/{plan.name}/predict"
    lua = loadgen.write_lua(work / f"{plan.name}.lua", plan.body_bytes)
    spy = py_spy() if args.py_spy else None
    spies: dict[int, tuple[subprocess.Popen[bytes], Path]] = {}
    snapshot: dict[str, Any] = {}

    def begin() -> None:
        snapshot["procs"] = server.cpu_by_process()
        snapshot["own"] = _own_cpu_s()
        snapshot["wall"] = time.monotonic()
        if spy:
            targets = [*snapshot["procs"], *([os.getpid()] if path == "direct" else [])]
            for pid in targets:
                out = work / f"spy-{plan.name}-{path}-{pid}.txt"
                spies[pid] = (start_py_spy(spy, pid, out, args.duration_s, args.rate), out)

    server.wait_idle()
    if path == "http":
        if args.warmup_s > 0:
            loadgen.run_wrk(url, lua, args.concurrency, args.warmup_s)
        server.wait_idle()
        begin()
        children_s = _children_cpu_s()  # py-spy's are not waited for yet: only wrk counts here
        m = loadgen.wrk_measurement("zserve-http", plan.name, args.concurrency,
                                    loadgen.run_wrk(url, lua, args.concurrency, args.duration_s))  # fmt: skip
        m.detail["wrk_cpu_s"] = _children_cpu_s() - children_s
        load_role = "wrk"
    else:
        m = loadgen.measure_direct(config, plan.name, plan.body, args.concurrency, args.duration_s, args.warmup_s,
                                   begin)  # fmt: skip
        load_role = "client (this process)"
    after = server.cpu_by_process()
    own_s = _own_cpu_s() - snapshot["own"]
    before, names = snapshot["procs"], _names(snapshot["procs"])
    answered = max(1, m.requests - m.errors)
    rows = []
    for pid, (_, _, cpu_before) in before.items():
        if pid in after and names[pid] != "supervisor":
            used = after[pid][2] - cpu_before
            rows.append({"process": names[pid], "pid": pid, "cpu_us_per_request": used * 1e6 / answered,
                         "cores": used / m.duration_s})  # fmt: skip
    if path == "direct":
        rows.append({"process": load_role, "pid": os.getpid(), "cpu_us_per_request": own_s * 1e6 / answered,
                     "cores": own_s / m.duration_s})  # fmt: skip
    else:
        wrk_s = m.detail.get("wrk_cpu_s")
        if wrk_s is not None:
            rows.append({"process": load_role, "pid": None, "cpu_us_per_request": wrk_s * 1e6 / answered,
                         "cores": wrk_s / m.duration_s})  # fmt: skip
    rows.sort(key=lambda r: -r["cpu_us_per_request"])
    profiles = {}
    for pid, (proc, out) in spies.items():
        try:
            proc.wait(timeout=args.duration_s + 30)
        except subprocess.TimeoutExpired:
            proc.kill()
        name = names.get(pid, "client (this process)")
        summary = summarise_raw(out, args.top)
        summary["busy_share"] = summary["samples"] / (args.rate * args.duration_s)
        profiles[f"{name}[{pid}]"] = summary
    return {"model": plan.name, "path": path, "concurrency": args.concurrency, "qps": m.qps, "p50_ms": m.p50_ms,
            "p99_ms": m.p99_ms, "answered": m.requests - m.errors, "errors": m.errors, "processes": rows,
            "py_spy": profiles}  # fmt: skip


def print_run(run: dict[str, Any]) -> None:
    print(f"\n{run['model']} over {run['path']} at c{run['concurrency']}: {run['qps']:,.1f} req/s, p50 "
          f"{run['p50_ms']:.2f} ms, p99 {run['p99_ms']:.2f} ms, {run['errors']} errors")  # fmt: skip
    print(f"  {'process':<24} {'pid':>8} {'CPU us/req':>11} {'cores':>6}")
    total = 0.0
    for row in run["processes"]:
        total += row["cpu_us_per_request"]
        print(f"  {row['process']:<24} {row['pid'] or '':>8} {row['cpu_us_per_request']:11.1f} {row['cores']:6.2f}")
    print(f"  {'all of them':<24} {'':>8} {total:11.1f}")
    by_role: collections.Counter[str] = collections.Counter()
    for row in run["processes"]:
        by_role[row["process"]] += row["cpu_us_per_request"]
    run["cpu_us_per_request_by_role"] = dict(by_role)
    print("  by hop (us/req): " + ", ".join(f"{role} {us:.1f}" for role, us in by_role.most_common() if us >= 0.05))
    for name, prof in run["py_spy"].items():
        if not prof["samples"]:
            continue
        print(f"  py-spy {name}: {prof['samples']} non-idle samples ({100 * prof['busy_share']:.0f}% of the run)")
        for frame, pct in prof["inclusive_pct"]:
            print(f"      incl {pct:5.1f}%  {frame[:110]}")
        for frame, pct in prof["own_pct"][:4]:
            print(f"      own  {pct:5.1f}%  {frame[:110]}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_signals()
    if "http" in args.paths and loadgen.wrk_path() is None:
        print("hops: `wrk` is not installed (apt-get install -y wrk), or use --paths direct", file=sys.stderr)
        return 2
    if args.py_spy and py_spy() is None:
        print("hops: py-spy is not installed (make bench-env installs it into .venv-bench)", file=sys.stderr)
        return 2
    config, plans = plan_models(args.config, args.models, args.threads)
    if args.workers is not None:
        config.frontends.workers = args.workers
    print(f"per-hop profile: {os.cpu_count()} cores; {config.frontends.workers} gunicorn workers; torch threads "
          + ", ".join(f"{p.name}={p.threads}" for p in plans)
          + f"; c{args.concurrency}, {args.duration_s:g}s after {args.warmup_s:g}s warm-up"
          + ("; py-spy on" if args.py_spy else ""), flush=True)  # fmt: skip
    runs = []
    with tempfile.TemporaryDirectory(prefix="zserve-hops-") as tmp:
        work = Path(tmp)
        config_path = work / "supervisor.toml"
        config_path.write_text(deployment_toml(config, free_port()))
        server, base_url = zserve_up(config_path, config.supervisor.startup_timeout_s + 30, env=clean_env())
        try:
            for plan in plans:
                for path in args.paths:
                    run = profile_run(server, plan, path, args, base_url, config_path, work)
                    print_run(run)
                    runs.append(run)
        finally:
            server.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.out.write_text(json.dumps({"meta": meta, "runs": runs}, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

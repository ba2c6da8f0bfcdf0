#!/usr/bin/env python
"""Issue 36's bigger model: a ~1.2B-parameter Llama GGUF in Q4_K with random weights, built from Llama-3.2-1B's
config with the ``gguf`` package (``tests/support/gguf_build.py``: hidden 2048, 16 layers, 32 heads, 8 key/value
heads, intermediate 8192, vocab 128256, tied embeddings; SmolLM2's tokenizer), loaded by the engine's loader
(``Generator.load``, ``quantization`` "auto": the blocks kept, no fp32 copy) in a fresh process, which then
serves a few requests together. Prints the process's resident memory (VmRSS) before loading, after loading,
after the requests, and its peak (VmHWM), against the 1.5 GB target and the fp32 model's bytes.

    .venv/bin/python -m bench.studies.gguf_1b --dir /tmp/gguf-1b     # builds the file once (~700 MB), then measures
    .venv/bin/python -m bench.studies.gguf_1b --dir /tmp/gguf-1b --engine   # also from a real engine process
    .venv/bin/python -m bench.studies.gguf_1b --dir /tmp/gguf-1b --delete   # and removes the file after

The file's conversion to fp32 (``quantization`` "none") would take ~5 GB of disk and memory: not run here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

MIB = 2**20
NAME = "llama-3.2-1b-random.Q4_K.gguf"
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "1, 2, 3, 4,", "Explain photosynthesis."]


def _status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def serve(args: argparse.Namespace) -> None:
    """In this (fresh) process: load, serve the prompts together, one JSON line."""
    import torch

    from bench.studies.quantized import fp32_bytes, model_bytes
    from zserve.generation import GenerateRequest
    from zserve.generator.generator import Generator
    from zserve.generator.options import GeneratorOptions

    torch.set_num_threads(args.threads)
    before = _status()["VmRSS"]
    started = time.perf_counter()
    options = GeneratorOptions(num_blocks=args.num_blocks, block_size=16, max_running=len(PROMPTS))
    engine = Generator.load(args.dir, gguf_file=NAME, options=options)
    load_s = time.perf_counter() - started
    loaded = _status()["VmRSS"]
    started = time.perf_counter()
    requests = [GenerateRequest(prompt=p, max_new_tokens=args.tokens, ignore_eos=True) for p in PROMPTS]
    engine.generate(requests)
    serve_s = time.perf_counter() - started
    after = _status()
    model = engine.core.model
    print(json.dumps({
        "rss_before": before, "rss_loaded": loaded, "rss_after": after["VmRSS"], "peak": after["VmHWM"],
        "load_s": load_s, "serve_s": serve_s, "model_bytes": model_bytes(model), "fp32_bytes": fp32_bytes(model),
    }))  # fmt: skip
    engine.close()


ENGINE_TOML = """
[[models]]
name = "lm"
handler = "zserve.models.causal_lm:CausalLM"
engines = 1
timeout_ms = 600000
[models.options]
path = "{folder}"
gguf_file = "{name}"
block_size = 16
num_blocks = {num_blocks}
max_running = {running}
max_new_tokens = {tokens}
"""


def _proc_status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def engine(args: argparse.Namespace) -> dict[str, float]:
    """The same file served by a real engine process behind a broker (tests/cluster.py: the supervisor's own
    command lines), the prompts sent at once by a client; the engine process's RSS once ready and after."""
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from cluster import Cluster

    toml = ENGINE_TOML.format(folder=args.dir, name=NAME, num_blocks=args.num_blocks, running=len(PROMPTS),
                              tokens=args.tokens)  # fmt: skip
    cluster = Cluster(toml, Path(tempfile.mkdtemp(prefix="gguf-1b-")))
    try:
        cluster.start_broker()
        pid = cluster.start_engine("lm").pid
        started = time.perf_counter()
        cluster.wait_ready({"lm": 1}, timeout_s=600)
        ready_s = time.perf_counter() - started
        ready = _proc_status(pid)
        client = cluster.client()
        started = time.perf_counter()
        futures = [
            client.submit("lm", {"prompt": p, "max_new_tokens": args.tokens, "ignore_eos": True}) for p in PROMPTS
        ]
        answers = [f.result(timeout=600) for f in futures]
        serve_s = time.perf_counter() - started
        after = _proc_status(pid)
    finally:
        cluster.stop()
    assert len(answers) == len(PROMPTS)
    return {"rss_ready": ready["VmRSS"], "rss_after": after["VmRSS"], "peak": after["VmHWM"], "ready_s": ready_s,
            "serve_s": serve_s}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/tmp/gguf-1b", help="where the GGUF is built (once) and read")
    p.add_argument("--serve", action="store_true", help="(internal) load and serve in this process")
    p.add_argument("--num-blocks", type=int, default=64, help="KV pool blocks of 16 tokens")
    p.add_argument("--tokens", type=int, default=16, help="tokens generated per request")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--engine", action="store_true", help="also serve it from a real engine process")
    p.add_argument("--delete", action="store_true", help="remove the GGUF after (its config cache stays)")
    args = p.parse_args(argv)
    if args.serve:
        serve(args)
        return 0
    folder = Path(args.dir)
    path = folder / NAME
    if not path.is_file():
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
        from gguf_build import LLAMA_3_2_1B, build_gguf

        folder.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        build_gguf(path.with_suffix(".tmp"), LLAMA_3_2_1B).rename(path)
        print(f"built {path} ({path.stat().st_size / MIB:.0f} MiB) in {time.perf_counter() - started:.0f} s")
    cmd = [sys.executable, "-m", "bench.studies.gguf_1b", "--serve", "--dir", args.dir, "--num-blocks",
           str(args.num_blocks), "--tokens", str(args.tokens), "--threads", str(args.threads)]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    print(f"{NAME} ({path.stat().st_size / MIB:.0f} MiB); KV pool {args.num_blocks} blocks of 16; "
          f"{len(PROMPTS)} requests x {args.tokens} tokens together, {args.threads} thread(s)")  # fmt: skip
    print("RSS before load | after load | after the requests | peak | weights held | fp32 model | load | requests")
    print(f"{r['rss_before'] / MIB:.0f} MiB | {r['rss_loaded'] / MIB:.0f} MiB | {r['rss_after'] / MIB:.0f} MiB | "
          f"{r['peak'] / MIB:.0f} MiB | {r['model_bytes'] / MIB:.0f} MiB | {r['fp32_bytes'] / MIB:.0f} MiB | "
          f"{r['load_s']:.1f} s | {r['serve_s']:.1f} s")  # fmt: skip
    if args.engine:
        e = engine(args)
        print("engine process (broker + engine, the supervisor's command lines): RSS once ready | after the "
              "requests | peak | start to ready | requests")  # fmt: skip
        print(f"{e['rss_ready'] / MIB:.0f} MiB | {e['rss_after'] / MIB:.0f} MiB | {e['peak'] / MIB:.0f} MiB | "
              f"{e['ready_s']:.1f} s | {e['serve_s']:.1f} s")  # fmt: skip
    if args.delete:
        path.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

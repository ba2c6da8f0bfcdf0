#!/usr/bin/env python
"""Cache-aware routing across engines against least-loaded admission, in one run (issue 35).

Each leg starts its own deployment (``zserve.serve``: broker, ``--engines`` generative engines of
``--threads`` torch threads each, one frontend worker), routing ``least_loaded`` or ``cache_aware``, and sends
two workloads through HTTP with the ``openai`` client (streamed /v1/completions; TTFT at the first text
chunk), ``--concurrency`` callers in a closed loop:

  * shared: ``--groups`` system prompts of ``--prefix`` tokens, each followed by ``--turns`` different user turns
    of ``--suffix`` tokens, in random order;
  * none: as many prompts of random words (``--prefix`` + ``--suffix`` tokens), nothing shared.

Reports per leg and workload TTFT p50/p99, output tok/s, and the engines' prefix-cache hit rate (cached prompt
tokens / prompt tokens, from the broker's health report), with the ratios cache_aware / least_loaded, and the hit
rate one engine with room for every prefix would reach (each prefix computed once: computed from the workload).

    .venv/bin/python -m bench.generation routing                      # SmolLM2-135M, 2 engines x 1 thread
    .venv/bin/python -m bench.generation routing --model tiny --groups 2 --turns 2 --prefix 64   # smoke run

Not yet here (issue 35's full table): Poisson arrivals at 70% of capacity (a closed loop stands in), multi-turn
chats, one hot prefix at 2x capacity, a peer router, and the broker's cost with 64 simulated engines. Writes
bench/results/routing-DATE-TIME.json.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common.paths import RESULTS
from bench.generation.workload import GenRequest, Timing, closed_loop, summarize, text_of_length
from bench.generation.zserve_leg import HANDLER, REQUEST_TIMEOUT_MS, SERVED_NAME, engine_options, resolve_model

TTFT_TARGET, TOK_S_TARGET, NONE_TOK_S_TARGET = 0.5, 1.0, 0.97  # the targets (shared TTFT/tok/s, none)


def workloads(tokenizer: Any, args: argparse.Namespace) -> dict[str, list[GenRequest]]:
    rng = random.Random(args.seed)
    shared = []
    for _ in range(args.groups):
        system = text_of_length(tokenizer, args.prefix, rng)
        for _ in range(args.turns):
            text = system + " " + text_of_length(tokenizer, args.suffix, rng)
            shared.append(GenRequest(text, tokenizer(text)["input_ids"], args.output))
    rng.shuffle(shared)
    none = []
    for _ in range(len(shared)):
        text = text_of_length(tokenizer, args.prefix + args.suffix, rng)
        none.append(GenRequest(text, tokenizer(text)["input_ids"], args.output))
    return {"shared": shared, "none": none}


def ideal_hit_rate(requests: list[GenRequest], block_size: int) -> float:
    """One engine that keeps every block: each block computed the first time it is seen, found after."""
    seen: set[tuple[int, ...]] = set()
    prompt = cached = 0
    for r in requests:
        ids = r.prompt_ids
        prompt += len(ids)
        for end in range(block_size, len(ids), block_size):  # the block holding the last token is never shared
            key = tuple(ids[:end])
            if key in seen:
                cached += block_size
            seen.add(key)
    return cached / prompt if prompt else 0.0


class HttpLeg:
    """One streamed completion per call through the deployment's HTTP frontend, with the openai client."""

    def __init__(self, url: str) -> None:
        import openai

        self.local = threading.local()
        self.make = lambda: openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
        self.mismatches: list[str] = []

    def __call__(self, request: GenRequest, deadline: float | None) -> Timing:
        client = getattr(self.local, "client", None) or self.make()
        self.local.client = client
        start = time.perf_counter()
        first = last = None
        tokens = 0
        stream = client.completions.create(
            model=SERVED_NAME, prompt=request.prompt_text, max_tokens=request.output_len, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                last = time.perf_counter()
                first = first or last
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        end = time.perf_counter()
        if tokens != request.output_len:
            self.mismatches.append(f"asked {request.output_len} tokens, got {tokens}")
        return Timing(start, first or end, last or end, tokens)


def counters(client: Any) -> tuple[int, int]:
    [model] = [m for m in client.health().models if m.name == SERVED_NAME]
    return model.prompt_tokens, model.cached_prompt_tokens


def run_leg(path: str, routing: str, loads: dict[str, list[GenRequest]], args: argparse.Namespace) -> list[dict]:
    import zserve

    tokens_per_seq = max(len(r.prompt_ids) for rs in loads.values() for r in rs) + args.output
    # room for every sequence a caller can have in flight, plus the prefixes kept between requests
    options = engine_options(path, args.dtype, args.concurrency, tokens_per_seq, args.max_batched_tokens)
    options["num_blocks"] += args.groups * (args.prefix // 16 + 1)
    client = zserve.serve(HANDLER, name=SERVED_NAME, options=options, engines=args.engines, threads=args.threads,
                          routing=routing, timeout_ms=REQUEST_TIMEOUT_MS, workers=1)  # fmt: skip
    rows = []
    try:
        deadline = time.monotonic() + 120
        while routing == "cache_aware" and "routing: tokenizer loaded" not in client.output:
            if time.monotonic() > deadline:
                raise RuntimeError("the frontend never loaded the tokenizer for routing")
            time.sleep(0.1)
        leg = HttpLeg(client.url)
        leg(GenRequest("warm up", [], 2), None)
        leg.mismatches.clear()
        for name, requests in loads.items():
            before = counters(client)
            callers = [requests[i :: args.concurrency] for i in range(args.concurrency)]
            timings, wall_s = closed_loop(leg, callers)
            prompt, cached = (a - b for a, b in zip(counters(client), before, strict=True))
            row = summarize(routing, args.concurrency, timings, wall_s).to_json()
            row |= {"workload": name, "routing": routing, "prompt_tokens": prompt, "cached_prompt_tokens": cached,
                    "hit_rate": cached / prompt if prompt else 0.0}  # fmt: skip
            print(f"  {routing} {name}: TTFT p50 {row['ttft_p50_ms']:.0f} ms, {row['tok_s']:.1f} tok/s, "
                  f"hit rate {row['hit_rate']:.3f}")  # fmt: skip
            rows.append(row)
        if leg.mismatches:
            raise RuntimeError(f"{routing}: wrong answers {leg.mismatches[:3]}")
    finally:
        code = client.terminate()
    if code:
        raise RuntimeError(f"{routing}: the deployment exited {code}")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="a transformers folder, smollm2 or tiny (default %(default)s)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine (default %(default)s)")
    p.add_argument("--groups", type=int, default=8, help="system prompts (default %(default)s)")
    p.add_argument("--turns", type=int, default=4, help="user turns per system prompt (default %(default)s)")
    p.add_argument("--prefix", type=int, default=400, help="system prompt tokens (default %(default)s)")
    p.add_argument("--suffix", type=int, default=16, help="user turn tokens (default %(default)s)")
    p.add_argument("--output", type=int, default=16, help="tokens generated per request (default %(default)s)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-batched-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="zserve-routing-bench-") as tmp:
        path = resolve_model(args.model, args.dtype, Path(tmp))
        loads = workloads(AutoTokenizer.from_pretrained(path), args)
        ideal = ideal_hit_rate(loads["shared"], 16)
        print(f"{len(loads['shared'])} requests per workload; one engine keeping every prefix would hit {ideal:.3f}")
        rows = [row for routing in ("least_loaded", "cache_aware") for row in run_leg(path, routing, loads, args)]
    by = {(r["routing"], r["workload"]): r for r in rows}
    print(f"{'ROUTING':>12} {'WORKLOAD':>8} {'REQS':>5} {'TTFT_P50_MS':>11} {'TTFT_P99_MS':>11} {'TOK/S':>7} "
          f"{'HIT_RATE':>8}")  # fmt: skip
    for r in rows:
        print(f"{r['routing']:>12} {r['workload']:>8} {r['requests']:>5} {r['ttft_p50_ms']:>11.0f} "
              f"{r['ttft_p99_ms']:>11.0f} {r['tok_s']:>7.1f} {r['hit_rate']:>8.3f}")  # fmt: skip
    ratios = {
        "shared_ttft_p50": by["cache_aware", "shared"]["ttft_p50_ms"] / by["least_loaded", "shared"]["ttft_p50_ms"],
        "shared_tok_s": by["cache_aware", "shared"]["tok_s"] / by["least_loaded", "shared"]["tok_s"],
        "shared_hit_vs_one_engine": by["cache_aware", "shared"]["hit_rate"] / ideal if ideal else 0.0,
        "none_tok_s": by["cache_aware", "none"]["tok_s"] / by["least_loaded", "none"]["tok_s"],
    }
    print(f"cache_aware / least_loaded: shared TTFT p50 {ratios['shared_ttft_p50']:.2f}x (target <= {TTFT_TARGET}), "
          f"tok/s {ratios['shared_tok_s']:.2f}x (target >= {TOK_S_TARGET}), hit rate "
          f"{ratios['shared_hit_vs_one_engine']:.2f}x one engine's (target >= 0.9); "
          f"none tok/s {ratios['none_tok_s']:.2f}x (target >= {NONE_TOK_S_TARGET}); "
          f"{args.engines} engines x {args.threads} threads")  # fmt: skip
    out = args.out or RESULTS / f"routing-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {"args": vars(args) | {"out": str(out)}, "rows": rows, "ideal_hit_rate": ideal, "ratios": ratios}
    out.write_text(json.dumps(document, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

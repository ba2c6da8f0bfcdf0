"""The in-process limit: zserve's embedding handler's forward (``predict``) on full batches, no serving around it.

Run as its own process by run.py (``python -m bench.embeddings.inprocess_limit --model-dir D --workload W ...``), so
torch starts with the thread settings of an engine (OMP_NUM_THREADS etc. from the environment, then
``torch.set_num_threads``). Batches are formed from the workload the way the HTTP load draws it (the seeded random
pick of the wrk script's list, ``--batch`` at a time), tokenized once beforehand; only the forward is timed.
``--order sorted`` sorts each window of ``--window`` arrivals by length before cutting batches (what a length-aware
batcher could do with that many requests queued). Padding efficiency = real tokens / padded tokens over the batches
formed. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from bench.common.measure import percentile
from bench.embeddings import embed_model
from bench.embeddings.workload import SEED, texts

SAMPLE_BATCHES = 64  # batches formed from the mixed workload (the timed loop cycles over them)


def arrivals(workload_texts: list[str], n: int) -> list[str]:
    if len(workload_texts) == 1:
        return workload_texts * n
    rng = random.Random(SEED)
    return [rng.choice(workload_texts) for _ in range(n)]


def form_batches(items: list[str], batch: int, order: str, window: int, tokens: dict[str, int]) -> list[list[str]]:
    if order == "sorted":
        ordered: list[str] = []
        for start in range(0, len(items), window):
            ordered.extend(sorted(items[start : start + window], key=lambda t: tokens[t]))
        items = ordered
    return [items[i : i + batch] for i in range(0, len(items) - batch + 1, batch)]


def measure(model_dir: str, workload: str, batch: int, order: str, window: int, threads: int, duration_s: float,
            options: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    model = embed_model.load(model_dir, threads, options)  # tokenizer and weights in this one process
    import torch

    pool = texts(workload, Path(model_dir))
    n_batches = 1 if len(pool) == 1 else SAMPLE_BATCHES
    items = arrivals(pool, n_batches * batch)
    one = embed_model.items
    tokens = {t: embed_model.padding(embed_model.preprocess(model, one(model, [t])))[0] for t in set(items)}
    batches = form_batches(items, batch, order, window, tokens)

    t0 = time.perf_counter()
    inputs = [embed_model.preprocess(model, embed_model.items(model, b)) for b in batches]
    tokenize_s = time.perf_counter() - t0
    counts = [embed_model.padding(x) for x in inputs]
    real, padded = sum(c[0] for c in counts), sum(c[1] for c in counts)

    model.predict(inputs[0])  # warm-up
    samples: list[float] = []
    calls = 0
    started = time.perf_counter()
    while time.perf_counter() - started < duration_s or calls < 2:
        x = inputs[calls % len(inputs)]
        c0 = time.perf_counter()
        model.predict(x)
        samples.append(time.perf_counter() - c0)
        calls += 1
    elapsed = time.perf_counter() - started
    samples.sort()
    return {
        "workload": workload,
        "order": order,
        "window": window if order == "sorted" else None,
        "batch": batch,
        "batches_formed": len(inputs),
        "calls": calls,
        "items": calls * batch,
        "elapsed_s": elapsed,
        "items_per_s": calls * batch / elapsed,
        "call_p50_ms": percentile(samples, 50) * 1000.0,
        "call_p99_ms": percentile(samples, 99) * 1000.0,
        "padding": {"real_tokens": real, "padded_tokens": padded, "efficiency": real / padded if padded else None},
        "tokenize_ms_per_item": tokenize_s * 1000.0 / max(1, sum(len(b) for b in batches)),
        "torch_threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--order", choices=["arrival", "sorted"], default="arrival")
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--option", action="append", default=[], help="a handler option KEY=VALUE (backend, dtype)")
    args = parser.parse_args()
    options = dict(option.split("=", 1) for option in args.option)
    result = measure(args.model_dir, args.workload, args.batch, args.order, args.window, args.threads, args.duration_s,
                     options)  # fmt: skip
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

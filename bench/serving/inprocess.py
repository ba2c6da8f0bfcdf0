"""The in-process limit: the model (``preprocess`` + ``predict``) called directly on a full batch, no serving around it.

Run as its own process (``python -m bench.serving.inprocess --config C --model M --duration-s D``), so that torch
starts with the same thread settings as an engine (OMP_NUM_THREADS etc. from the environment, then
``torch.set_num_threads``); prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from bench.common.measure import percentile
from zserve.config import load_config
from zserve.model import load_handler, predict_inline, setup_inline

MIN_CHUNK_S = 0.002  # calls shorter than this are timed in chunks (echo: a call is well under a microsecond)


def measure(config_path: str, name: str, body: object, duration_s: float) -> dict[str, object]:
    spec = load_config(config_path).model(name)
    model = load_handler(spec.handler, spec.options)
    setup_inline(model)  # tokeniser and weights in this one process
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(spec.threads)
    batch = [model.decode_request(body) for _ in range(spec.max_batch_size)]

    # Warm up with the full batch, and learn how many calls make a chunk worth timing.
    chunk = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(chunk):
            predict_inline(model, batch)
        if time.perf_counter() - t0 >= MIN_CHUNK_S:
            break
        chunk *= 4

    samples: list[float] = []  # seconds per call, one per chunk
    started = time.perf_counter()
    while time.perf_counter() - started < duration_s or len(samples) < 3:
        t0 = time.perf_counter()
        for _ in range(chunk):
            predict_inline(model, batch)
        samples.append((time.perf_counter() - t0) / chunk)
    elapsed = time.perf_counter() - started
    calls = len(samples) * chunk
    samples.sort()
    torch = sys.modules.get("torch")
    return {
        "batch": spec.max_batch_size,
        "calls": calls,
        "items": calls * spec.max_batch_size,
        "elapsed_s": elapsed,
        "items_per_s": calls * spec.max_batch_size / elapsed,
        "call_p50_ms": percentile(samples, 50) * 1000.0,
        "call_p99_ms": percentile(samples, 99) * 1000.0,
        "calls_per_sample": chunk,
        "threads": spec.threads,
        "torch_threads": torch.get_num_threads() if torch else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--body-json", required=True)
    parser.add_argument("--duration-s", type=float, default=10.0)
    args = parser.parse_args()
    print(json.dumps(measure(args.config, args.model, json.loads(args.body_json), args.duration_s)), flush=True)


if __name__ == "__main__":
    main()

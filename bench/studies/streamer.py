"""In-process batching: the embedding model through ``zserve.Streamer`` (threads, and ``processes=2``)
against the model called one request at a time, at 1, 16 and 64 caller threads, in one run.
One command: ``.venv/bin/python -m bench.studies.streamer``.

Targets (issue "In-process batching"): Streamer >= 2x one-at-a-time throughput at 64 callers, and
<= 1 ms added p50 at 1 caller.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common.measure import percentile
from bench.common.paths import RESULTS

TEXT = "zserve batches many small independent requests into well filled batches on every engine"


def closed_loop(call: Callable[[list[Any]], Any], callers: int, duration_s: float) -> dict[str, float]:
    latencies: list[float] = []
    lock = threading.Lock()
    stop_at = time.perf_counter() + duration_s

    def caller() -> None:
        mine = []
        while (t0 := time.perf_counter()) < stop_at:
            call([TEXT])
            mine.append(time.perf_counter() - t0)
        with lock:
            latencies.extend(mine)

    started = time.perf_counter()
    threads = [threading.Thread(target=caller) for _ in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "qps": len(latencies) / elapsed,
        "p50_ms": percentile(latencies, 50) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="torch threads in this process (default 2)")
    parser.add_argument("--callers", default="1,16,64")
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    callers = [int(c) for c in args.callers.split(",")]

    import torch

    from zserve import Streamer
    from zserve.model import predict_inline
    from zserve.models.embedding import SentenceEmbedding

    torch.set_num_threads(args.threads)
    model = SentenceEmbedding()
    model.setup_preprocess()
    model.setup("cpu")
    model.warmup()
    one_lock = threading.Lock()

    def one_at_a_time(items: list[Any]) -> Any:
        with one_lock:
            return predict_inline(model, items)

    cores = os.cpu_count() or 1
    print(f"streamer bench: {cores} cores; torch threads {args.threads} in-thread, 1 per process with "
          f"processes=2; max_batch_size {args.max_batch_size}; {args.duration_s:g} s per run", flush=True)  # fmt: skip
    results: dict[str, dict[int, dict[str, float]]] = {"one-at-a-time": {}, "streamer-threads": {}}
    for c in callers:
        results["one-at-a-time"][c] = closed_loop(one_at_a_time, c, args.duration_s)
    with Streamer(model, max_batch_size=args.max_batch_size, max_wait_ms=5) as streamer:
        closed_loop(streamer.predict, 4, 1.0)  # warm-up
        for c in callers:
            results["streamer-threads"][c] = closed_loop(streamer.predict, c, args.duration_s)
    os.environ["OMP_NUM_THREADS"] = "1"  # the spawned processes import torch with one thread each
    results["streamer-processes=2"] = {}
    with Streamer(SentenceEmbedding(), processes=2, max_batch_size=args.max_batch_size, max_wait_ms=5) as streamer:
        closed_loop(streamer.predict, 4, 1.0)
        for c in callers:
            results["streamer-processes=2"][c] = closed_loop(streamer.predict, c, args.duration_s)

    print(f"\n{'scenario':<22} {'callers':>7} {'QPS':>9} {'p50 ms':>9} {'p99 ms':>9} {'x one':>7}")
    for name, by_c in results.items():
        for c, r in by_c.items():
            ratio = r["qps"] / results["one-at-a-time"][c]["qps"]
            print(f"{name:<22} {c:>7} {r['qps']:>9.1f} {r['p50_ms']:>9.2f} {r['p99_ms']:>9.2f} {ratio:>7.2f}")
    print("\nTargets:")
    hi, lo = max(callers), min(callers)
    for name in ("streamer-threads", "streamer-processes=2"):
        ratio = results[name][hi]["qps"] / results["one-at-a-time"][hi]["qps"]
        added = results[name][lo]["p50_ms"] - results["one-at-a-time"][lo]["p50_ms"]
        print(f"  [{'MET   ' if ratio >= 2 else 'MISSED'}] {name} >= 2x one-at-a-time at {hi} callers: {ratio:.2f}x")
        print(f"  [{'MET   ' if added <= 1 else 'MISSED'}] {name} adds <= 1 ms p50 at {lo} caller: {added:+.2f} ms")
    out = args.out or RESULTS / time.strftime("streamer-%Y%m%d-%H%M%S.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args) | {"out": str(out)}, "results": results}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

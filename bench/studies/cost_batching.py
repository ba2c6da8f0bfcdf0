"""Count-only against cost-aware batching (issue 14): the embedding model (all-MiniLM-L6-v2, its
preprocess stage tokenising) on mixed text lengths, 80% of 10-30 tokens and 20% of 200-400, closed loop
at concurrency C through the direct client, one deployment per mode in the same run. Each request carries
its token count as its cost (what the frontends compute with ``Model.cost``). Reports throughput,
latency, mean batch size and padding efficiency (real tokens / tokens the batches computed).

    .venv/bin/python -m bench.studies.cost_batching [--concurrency 64] [--duration-s 20] [--max-batch-cost 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import zserve
from bench.common.paths import RESULTS, with_repo_path
from bench.studies.padded_embedding import PaddingReportingEmbedding

WORDS = (
    "the of and to in is was for on are with as his they be at one have this from or had by word but what "
    "some we can out other were all there when up use your how said an each she which do their time if will "
    "way about many then them write would like so these her long make thing see him two has look more day "
    "could go come did number sound no most people my over know water than call first who may down side been "
    "now find any new work part take get place made live where after back little only round man year came show "
    "every good me give our under name very through just form sentence great think say help low line differ"
).split()


def workload(n: int, seed: int, model: PaddingReportingEmbedding) -> list[tuple[str, int]]:
    """(text, tokens): 80% of 10-30 tokens, 20% of 200-400, tokens counted by the model's own tokenizer."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        target = rng.randint(200, 400) if rng.random() < 0.2 else rng.randint(10, 30)
        words = [rng.choice(WORDS) for _ in range(target - 2)]  # [CLS] and [SEP] make up the rest
        text = " ".join(words)
        out.append((text, model.cost(text)))
    return out


def run_mode(name: str, max_batch_cost: int, args: argparse.Namespace, texts: list[tuple[str, int]]) -> dict:
    os.environ["PYTHONPATH"] = with_repo_path()["PYTHONPATH"]  # zserve.serve's engine imports the handler below
    client = zserve.serve(
        "bench.studies.padded_embedding:PaddingReportingEmbedding",
        name="embed",
        max_batch_size=args.max_batch_size,
        max_wait_ms=args.max_wait_ms,
        max_batch_cost=max_batch_cost,
        threads=args.threads,
        workers=1,
        max_queue=4096,
        timeout_ms=120_000,
    )
    try:
        done: list[tuple[float, float, int, int, int]] = []  # (finished, latency, tokens, padded, batch)
        lock = threading.Lock()
        stop_at = [0.0]
        rng = random.Random(args.seed + 1)
        all_done = threading.Event()
        outstanding = [0]

        def send() -> None:
            text, tokens = texts[rng.randrange(len(texts))]
            started = time.perf_counter()
            future = client.submit("embed", {"text": text}, meta=True, cost=tokens)
            future.add_done_callback(lambda f, s=started: finished(f, s))

        def finished(future, started: float) -> None:
            now = time.perf_counter()
            answer = future.result()
            out = answer.value
            with lock:
                done.append((now, now - started, out["tokens"], out["padded"], answer.batch_size))
                if now < stop_at[0]:
                    send()
                    return
                outstanding[0] -= 1
                if outstanding[0] == 0:
                    all_done.set()

        start = time.perf_counter()
        warm_until = start + args.warmup_s
        stop_at[0] = warm_until + args.duration_s
        with lock:
            outstanding[0] = args.concurrency
            for _ in range(args.concurrency):
                send()
        all_done.wait(timeout=args.warmup_s + args.duration_s + 300)
        measured = [d for d in done if warm_until <= d[0] < stop_at[0]]
        latencies = sorted(d[1] for d in measured)
        health = next(m for m in client.health().models if m.name == "embed")
        row = {
            "mode": name,
            "max_batch_cost": max_batch_cost,
            "answers": len(measured),
            "qps": len(measured) / args.duration_s,
            "p50_ms": 1000 * latencies[len(latencies) // 2],
            "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "mean_batch": statistics.fmean(d[4] for d in measured),
            "padding_efficiency": sum(d[2] for d in measured) / sum(d[3] for d in measured),
            "broker_padding_efficiency": health.batched_cost / health.padded_cost if health.padded_cost else None,
        }
        print(
            f"  {name:<11} {row['qps']:8.1f}/s  p50 {row['p50_ms']:8.0f} ms  p99 {row['p99_ms']:8.0f} ms  "
            f"mean batch {row['mean_batch']:5.1f}  padding efficiency {row['padding_efficiency']:.2f}",
            flush=True,
        )
        return row
    finally:
        client.terminate()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--duration-s", type=float, default=20.0)
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    p.add_argument("--max-batch-cost", type=int, default=4096, help="the cost-aware mode's budget (tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "cost-batching.json"))
    args = p.parse_args()
    texts = workload(2000, args.seed, PaddingReportingEmbedding())
    long_share = sum(t > 100 for _, t in texts) / len(texts)
    print(
        f"cost batching bench  {time.strftime('%Y-%m-%dT%H:%M:%S%z')}  {os.cpu_count()} cores  engine threads "
        f"{args.threads}  c{args.concurrency}  {args.duration_s:.0f}s after {args.warmup_s:.0f}s warm-up  "
        f"max_batch_size {args.max_batch_size}  max_wait_ms {args.max_wait_ms}  "
        f"texts: {1 - long_share:.0%} short / {long_share:.0%} long",
        flush=True,
    )
    rows = [run_mode("count-only", 0, args, texts), run_mode("cost-aware", args.max_batch_cost, args, texts)]
    count, cost = rows
    print(
        f"cost-aware / count-only: throughput {cost['qps'] / count['qps']:.2f}x (target >= 1.5x), "
        f"p99 {cost['p99_ms'] / count['p99_ms']:.2f}x (target < 1.0x), padding efficiency "
        f"{count['padding_efficiency']:.2f} -> {cost['padding_efficiency']:.2f}"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

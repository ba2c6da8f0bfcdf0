"""Overlap benchmark: preprocess on a stage pool beside the engines, against the same work done serially
inside the engine process. One command: ``.venv/bin/python -m bench.studies.overlap``.

Synthetic model: ``preprocess`` burns ``--burn-ms`` of CPU per item (holds a core), ``predict`` spends
``--device-ms`` per batch without holding a CPU (a sleep standing in for a GPU kernel). Measured in one run,
with the direct client at ``--concurrency``:
  (a) inline: preprocess inside the engine, serially (bench.studies.burn_models:BurnInline)
  (b) staged: zserve with ``--stages`` preprocess processes (bench.studies.burn_models:BurnStaged)
next to the stage capacity (stages x items/s of one preprocess process, measured here) and the engine
capacity (batch / device time). Targets: (b) >= 0.9 x min(capacities) and >= 1.7 x (a). Then the
embedding model both ways (tokeniser on a stage vs in the engine) and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.common.loadgen import measure_direct
from bench.common.paths import RESULTS, with_repo_path
from bench.common.procs import free_port, stop_on_signals, zserve_up
from bench.studies.burn_models import BurnStaged

EMBED_BODY = {"text": "zserve batches many small independent requests into well filled batches on every engine"}


def deployment(port: int, args: argparse.Namespace) -> str:
    burn = f"burn_ms = {args.burn_ms}\ndevice_ms = {args.device_ms}\n"
    common = f"max_batch_size = {args.batch}\nmax_wait_ms = 5\nmax_queue = 4096\ncredits = 2\n"
    return f"""
[frontends]
workers = 1
port = {port}

[[models]]
name = "staged"
handler = "bench.studies.burn_models:BurnStaged"
preprocess_workers = {args.stages}
{common}[models.options]
{burn}
[[models]]
name = "inline"
handler = "bench.studies.burn_models:BurnInline"
{common}[models.options]
{burn}
[[models]]
name = "minilm-staged"
handler = "zserve.models.embedding:SentenceEmbedding"
threads = {args.embed_threads}
preprocess_workers = 1
{common}
[[models]]
name = "minilm-inline"
handler = "bench.studies.burn_models:InlineEmbedding"
threads = {args.embed_threads}
{common}"""


def stage_items_per_s(args: argparse.Namespace) -> float:
    """One preprocess process's throughput, measured here on full batches."""
    model = BurnStaged(args.burn_ms, args.device_ms)
    batch = list(range(args.batch))
    t0 = time.perf_counter()
    for _ in range(5):
        model.preprocess(batch)
    return 5 * args.batch / (time.perf_counter() - t0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--burn-ms", type=float, default=1.0, help="CPU per item in preprocess (default 1.0)")
    parser.add_argument("--device-ms", type=float, default=32.0, help="device time per batch (default 32)")
    parser.add_argument("--batch", type=int, default=32, help="max_batch_size (default 32)")
    parser.add_argument("--stages", type=int, default=1, help="preprocess processes (default 1)")
    parser.add_argument("--embed-threads", type=int, default=1, help="torch threads of the embedding engines")
    # 4 batches in flight: one in a stage, one in the engine, one on its way back, one queued. At 2 batches
    # (c64) a closed loop cannot keep both sides busy, whatever the server does.
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    stop_on_signals()

    stage_cap = args.stages * stage_items_per_s(args)
    engine_cap = args.batch / (args.device_ms / 1000.0)
    serial_cap = args.batch / ((args.batch * args.burn_ms + args.device_ms) / 1000.0)
    print(f"overlap bench: {os.cpu_count()} cores; burn {args.burn_ms} ms/item, device {args.device_ms} ms/batch "
          f"of {args.batch}; {args.stages} stage(s); direct client at c{args.concurrency}; "
          f"embedding engines {args.embed_threads} torch thread(s)")  # fmt: skip
    print(f"capacities: stage pool {stage_cap:,.0f} items/s, engine {engine_cap:,.0f} items/s, "
          f"serial (a) bound {serial_cap:,.0f} items/s", flush=True)  # fmt: skip

    env = with_repo_path()  # the engines import the handlers of bench/studies/burn_models.py
    results = {}
    with tempfile.TemporaryDirectory(prefix="zserve-overlap-") as tmp:
        config = Path(tmp) / "supervisor.toml"
        config.write_text(deployment(free_port(), args))
        server, _ = zserve_up(config, startup_timeout_s=300, env=env)
        try:
            for name, body in (("inline", {"x": 1}), ("staged", {"x": 1}),
                               ("minilm-inline", EMBED_BODY), ("minilm-staged", EMBED_BODY)):  # fmt: skip
                m = measure_direct(config, name, body, args.concurrency, args.duration_s, args.warmup_s)
                results[name] = m
                print(f"  {name:<14} {m.qps:9.1f}/s  p50 {m.p50_ms:8.2f} ms  p99 {m.p99_ms:8.2f} ms  "
                      f"mean batch {m.detail['mean_batch_size'] or 0:.1f}  errors {m.errors}", flush=True)  # fmt: skip
        finally:
            server.close()

    a, b = results["inline"].qps, results["staged"].qps
    bound = min(stage_cap, engine_cap)
    checks = [
        (f"(b) staged >= 0.9 x min(stage {stage_cap:,.0f}, engine {engine_cap:,.0f}) = {0.9 * bound:,.0f}/s",
         b >= 0.9 * bound, f"{b:,.0f}/s = {b / bound:.2f}x"),
        ("(b) staged >= 1.7 x (a) inline", b >= 1.7 * a, f"{b / a:.2f}x ({b:,.0f} vs {a:,.0f}/s)"),
    ]  # fmt: skip
    embed_ratio = results["minilm-staged"].qps / results["minilm-inline"].qps
    print("\nTargets:")
    for text, ok, got in checks:
        print(f"  [{'MET   ' if ok else 'MISSED'}] {text}: {got}")
    print(f"  embedding, tokeniser on a stage vs in the engine: {embed_ratio:.2f}x "
          f"({results['minilm-staged'].qps:.1f} vs {results['minilm-inline'].qps:.1f}/s)")  # fmt: skip

    out = args.out or RESULTS / time.strftime("overlap-%Y%m%d-%H%M%S.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "args": vars(args) | {"out": str(out)},
        "capacities": {"stage_pool": stage_cap, "engine": engine_cap, "serial_bound": serial_cap},
        "results": {k: v.to_json() for k, v in results.items()},
        "embedding_ratio": embed_ratio,
    }, indent=2))  # fmt: skip
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

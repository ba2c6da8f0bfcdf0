#!/usr/bin/env python
"""Where a decode step's time goes, in process on the engine core: the step, its linear products, its
attention, and the rest (norms, rotary, SiLU, embedding, metadata, sampling, Python and dispatch), at a few
batch sizes, for each ``model_impl`` (zserve's own Llama-family code against Hugging Face's modules).

B sequences of ``--prompt`` tokens are prefilled, then ``--steps`` decode steps are timed; the products and
the attention are timed by wrapping ``PackedLinear``/``nn.Linear`` and ``PagedKVCache.attend`` (two clock
reads per call, ~0.1 ms per step on SmolLM2's 30 layers). One torch thread unless ``--threads``.

    flock /tmp/zserve-cpu.lock .venv/bin/python bench/gen_step.py                 # SmolLM2-135M, B 1,8,32
    .venv/bin/python bench/gen_step.py --model tiny --batch 1,4 --steps 3         # a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import gen_zserve
import report
from bench_paths import RESULTS
from zserve.stages.generate import cpu_linear
from zserve.stages.generate.attention import PagedKVCache
from zserve.stages.generate.engine import EngineOptions, GenerativeEngine
from zserve.stages.generate.sequence import SamplingParams


@dataclass
class _Clock:
    linear_s: float = 0.0
    attention_s: float = 0.0


def _instrument(clock: _Clock) -> None:
    """Time every linear product and every attention call (the classes' methods, once per process)."""

    def timed(fn, field):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            setattr(clock, field, getattr(clock, field) + time.perf_counter() - t0)
            return out

        return wrapper

    nn.Linear.forward = timed(nn.Linear.forward, "linear_s")
    cpu_linear.PackedLinear.forward = timed(cpu_linear.PackedLinear.forward, "linear_s")
    PagedKVCache.attend = timed(PagedKVCache.attend, "attention_s")


def measure(path: str, impl: str, batches: list[int], prompt: int, steps: int, clock: _Clock) -> list[dict]:
    options = EngineOptions(num_blocks=2048, block_size=16, max_batched_tokens=2048, max_running=256, model_impl=impl)
    engine = GenerativeEngine.load(path, options=options)
    core = engine.core
    rows = []
    for b in batches:
        for i in range(b):
            ids = [(7 * i + j) % 1000 + 10 for j in range(prompt)]
            core.add(i, ids, SamplingParams(max_new_tokens=steps + 4, ignore_eos=True))
        while core.stats.batch_tokens != b or any(s.num_computed < prompt for s in core.sequences.values()):
            core.step()  # prefill (and the first decodes)
        times, linear, attention = [], [], []
        for _ in range(steps):
            clock.linear_s = clock.attention_s = 0.0
            t0 = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - t0)
            linear.append(clock.linear_s)
            attention.append(clock.attention_s)
        for i in range(b):
            core.abort(i)
        step = statistics.median(times)
        lin, att = statistics.median(linear), statistics.median(attention)
        rows.append({"impl": impl, "batch": b, "step_ms": step * 1e3, "linear_ms": lin * 1e3,
                     "attention_ms": att * 1e3, "other_ms": (step - lin - att) * 1e3})  # fmt: skip
    engine.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="a transformers folder, smollm2 or tiny (default %(default)s)")
    p.add_argument("--impls", default="transformers,zserve", help="model_impl values (default %(default)s)")
    p.add_argument("--batch", default="1,8,32", help="decode batch sizes (default %(default)s)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence (default %(default)s)")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per batch (default %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default %(default)s)")
    p.add_argument("--out", default=str(RESULTS / "gen_step.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = _Clock()
    _instrument(clock)
    batches = [int(b) for b in args.batch.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = gen_zserve.resolve_model(args.model, "float32", Path(tmp))
        with torch.inference_mode():
            for impl in args.impls.split(","):
                rows += measure(path, impl, batches, args.prompt, args.steps, clock)
    print(f"{'impl':<13}{'batch':>6}{'step ms':>10}{'linear':>9}{'attention':>11}{'other':>8}")
    for r in rows:
        print(f"{r['impl']:<13}{r['batch']:>6}{r['step_ms']:>10.2f}{r['linear_ms']:>9.2f}"
              f"{r['attention_ms']:>11.2f}{r['other_ms']:>8.2f}")  # fmt: skip
    report.write_json(Path(args.out), {"args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

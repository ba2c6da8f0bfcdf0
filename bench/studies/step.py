#!/usr/bin/env python
"""Where a decode step's time goes, in process on the engine core: the step, its linear products, its
attention, and the rest (norms, rotary, SiLU, embedding, metadata, sampling, Python and dispatch), at a few
batch sizes, for each ``model_impl`` (zserve's own Llama-family code against Hugging Face's modules).

B sequences of ``--prompt`` tokens are prefilled in each impl's engine, then ``--steps`` decode steps are timed,
the engines taking turns; the products and
the attention are timed by wrapping ``PackedLinear``/``nn.Linear`` and ``PagedKVCache.attend`` (two clock
reads per call, ~0.1 ms per step on SmolLM2's 30 layers). One torch thread unless ``--threads``; with one,
the clock is the thread's CPU time (``time.thread_time``: all the work runs on the calling thread, and other
processes on a shared machine do not count), else the wall clock.

``--isa avx2,avx512`` runs each ISA in its own process, our kernels built for it and oneDNN/MKL/ATen capped
to it (``bench/studies/isa.py``); ``--cpu-linear`` the engine's option of that name (default auto).

    flock /tmp/zserve-cpu.lock .venv/bin/python -m bench.studies.step                 # SmolLM2-135M, B 1,8,32
    .venv/bin/python -m bench.studies.step --impls zserve --batch 1,8,32 --isa avx2,avx512
    .venv/bin/python -m bench.studies.step --model tiny --batch 1,4 --steps 3         # a smoke run
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
from msgspec.structs import replace
from torch import nn

from bench.common import report
from bench.common.paths import RESULTS
from bench.generation import zserve_leg
from bench.studies import isa as study_isa
from zserve.generator import cpu_linear
from zserve.generator.attention import PagedKVCache
from zserve.generator.generator import Generator, GeneratorOptions
from zserve.generator.sequence import SamplingParams


@dataclass
class _Clock:
    linear_s: float = 0.0
    attention_s: float = 0.0
    now = staticmethod(time.perf_counter)


def _instrument(clock: _Clock) -> None:
    """Time every linear product and every attention call (the classes' methods, once per process)."""

    def timed(fn, field):
        def wrapper(*args, **kwargs):
            t0 = clock.now()
            out = fn(*args, **kwargs)
            setattr(clock, field, getattr(clock, field) + clock.now() - t0)
            return out

        return wrapper

    nn.Linear.forward = timed(nn.Linear.forward, "linear_s")
    cpu_linear.PackedLinear.forward = timed(cpu_linear.PackedLinear.forward, "linear_s")
    PagedKVCache.attend = timed(PagedKVCache.attend, "attention_s")


def measure(
    path: str, impls: list[str], batches: list[int], prompt: int, steps: int, clock: _Clock, cpu_linear: str = "auto"
) -> list[dict]:  # fmt: skip
    """Every impl's engine loaded side by side and stepped in turn (A, B, A, B...), so that whatever else the
    machine does at the time falls on all of them alike."""
    options = GeneratorOptions(num_blocks=2048, block_size=16, max_batched_tokens=2048, max_running=256,
                               cpu_linear=cpu_linear)  # fmt: skip
    engines = {}
    for impl in impls:  # "zserve@bfloat16": the model_impl, then the dtype (float32 unless named)
        model_impl, _, dtype = impl.partition("@")
        engines[impl] = Generator.load(path, dtype=dtype or "float32", options=replace(options, model_impl=model_impl))
    rows = []
    for b in batches:
        samples: dict[str, list[tuple[float, float, float]]] = {impl: [] for impl in impls}
        for engine in engines.values():
            core = engine.core
            for i in range(b):
                ids = [(7 * i + j) % 1000 + 10 for j in range(prompt)]
                core.add(i, ids, SamplingParams(max_new_tokens=steps + 4, ignore_eos=True))
            while core.stats.batch_tokens != b or any(s.num_computed < prompt for s in core.sequences.values()):
                core.step()  # prefill (and the first decodes)
        for _ in range(steps):
            for impl, engine in engines.items():
                clock.linear_s = clock.attention_s = 0.0
                t0 = clock.now()
                engine.core.step()
                samples[impl].append((clock.now() - t0, clock.linear_s, clock.attention_s))
        for impl, engine in engines.items():
            for i in range(b):
                engine.core.abort(i)
            step, lin, att = (statistics.median(column) for column in zip(*samples[impl], strict=True))
            rows.append({"impl": impl, "batch": b, "step_ms": step * 1e3, "linear_ms": lin * 1e3,
                         "attention_ms": att * 1e3, "other_ms": (step - lin - att) * 1e3})  # fmt: skip
    for engine in engines.values():
        engine.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="a transformers folder, smollm2 or tiny (default %(default)s)")
    p.add_argument(
        "--impls",
        default="transformers,zserve",
        help="model_impl values, each with an optional @dtype: zserve@bfloat16 (default %(default)s)",
    )
    p.add_argument("--batch", default="1,8,32", help="decode batch sizes (default %(default)s)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence (default %(default)s)")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per batch (default %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default %(default)s)")
    p.add_argument("--cpu-linear", default="auto", help="the engine's cpu_linear option (default %(default)s)")
    p.add_argument("--out", default=str(RESULTS / "gen_step.json"))
    study_isa.add_argument(p)
    args = p.parse_args(argv)
    results = study_isa.delegate("bench.studies.step", argv, study_isa.parse(args.isa), Path(args.out))
    if results is not None:
        print(f"\nside by side ({study_isa.cpu()}):")
        for isa, data in results:
            for r in data["rows"]:
                print(f"  {isa:<9}{r['impl']:<18}{r['batch']:>6}{r['step_ms']:>10.2f}{r['linear_ms']:>9.2f}"
                      f"{r['attention_ms']:>11.2f}{r['other_ms']:>8.2f}")  # fmt: skip
        report.write_json(Path(args.out), {"args": vars(args), "cpu": study_isa.cpu(), "isas": dict(results)})
        return 0
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("zserve.engine").setLevel(logging.INFO)  # the kernels' choice, in one line
    print(f"{study_isa.cpu()}\n{study_isa.describe()}; cpu_linear {args.cpu_linear}")
    torch.set_num_threads(args.threads)
    clock = _Clock()
    if args.threads == 1:
        clock.now = time.thread_time
    _instrument(clock)
    batches = [int(b) for b in args.batch.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = zserve_leg.resolve_model(args.model, "float32", Path(tmp))
        with torch.inference_mode():
            rows = measure(path, args.impls.split(","), batches, args.prompt, args.steps, clock, args.cpu_linear)
    print(f"{'impl':<18}{'batch':>6}{'step ms':>10}{'linear':>9}{'attention':>11}{'other':>8}")
    for r in rows:
        print(f"{r['impl']:<18}{r['batch']:>6}{r['step_ms']:>10.2f}{r['linear_ms']:>9.2f}"
              f"{r['attention_ms']:>11.2f}{r['other_ms']:>8.2f}")  # fmt: skip
    clock_name = "thread CPU time" if args.threads == 1 else "wall clock"
    print(f"(medians of {args.steps} decode steps after prompts of {args.prompt} tokens; {clock_name})")
    report.write_json(Path(args.out), {"args": vars(args), "clock": clock_name, "cpu": study_isa.cpu(),
                                       "isa": study_isa.describe(), "rows": rows})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

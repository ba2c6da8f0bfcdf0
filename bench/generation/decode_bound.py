#!/usr/bin/env python
"""Decode step time against the memory-bandwidth bound, for the zserve engine core (in process,
``zserve.pipeline``) and for ``model.generate``, on uniform batches.

A decode step has to read every weight once and, for each sequence, its KV cache so far, so it cannot be
faster than (weight bytes + KV bytes) / memory bandwidth. The step time is measured as
(time to generate N + 1 tokens - time to generate 1 token) / N for a batch of B prompts of the same length:
the prefill cancels out. Meant for a GPU (``bench/gpu/run_generate.sh``); on a CPU the bound is about the
DRAM bandwidth given with ``--bandwidth-gbs``.

    .venv/bin/python -m bench.generation decode-bound --device cuda --batch 1,8,32,64 --bandwidth-gbs 4800
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import report
from bench.common.paths import RESULTS
from bench.generation import baselines, zserve_leg
from bench.generation.workload import uniform_batch


def kv_bytes_per_token(config: Any, itemsize: int) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * itemsize


def engine_step_s(pipe: Any, texts: list[str], steps: int, repeats: int = 2) -> float:
    def timed(new_tokens: int) -> float:
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            pipe(texts, max_new_tokens=new_tokens, ignore_eos=True)
            best = min(best, time.perf_counter() - t0)
        return best

    return (timed(steps + 1) - timed(1)) / steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="a transformers folder, smollm2 or tiny (default %(default)s)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", default="1,8,32,64", help="batch sizes (default %(default)s)")
    p.add_argument("--context", type=int, default=512, help="prompt tokens of every sequence (default %(default)s)")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed (default %(default)s)")
    p.add_argument("--bandwidth-gbs", type=float, default=4800.0, help="memory bandwidth, GB/s (default: H200)")
    p.add_argument("--max-batched-tokens", type=int, default=4096, help="the engine's token budget per step")
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--out", type=Path, default=RESULTS / "issue4-decode-bound.json")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",") if b]

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory(prefix="zserve-decode-bound-") as tmp:
        path = zserve_leg.resolve_model(args.model, args.dtype, Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).to(args.device)
        gen = baselines.HFGenerator(model, tokenizer, args.device)
        gen.warm_up()
        weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())  # tied weights once
        kv_token = kv_bytes_per_token(model.config, model.dtype.itemsize)
        tokens = args.context + args.steps + 1
        pipe = zserve_leg.engine_pipeline(path, args.device, args.dtype, max(batches), tokens, args.max_batched_tokens)
        bw = args.bandwidth_gbs * 1e9
        print(f"decode bound: {path} {args.dtype} on {args.device}; weights {weight_bytes / 1e6:.1f} MB "
              f"-> {weight_bytes / bw * 1e6:.1f} us per step at {args.bandwidth_gbs:g} GB/s; KV {kv_token} B/token; "
              f"context {args.context}, {args.steps} steps timed", flush=True)  # fmt: skip
        for b in batches:
            requests = uniform_batch(tokenizer, b, args.context, args.steps + 1, seed=b)
            ended = gen.generate([r.prompt_ids for r in requests], args.steps + 1)
            hf_s = (ended[-1] - ended[0]) / args.steps
            core_s = engine_step_s(pipe, [r.prompt_text for r in requests], args.steps)
            kv_bytes = b * (args.context + args.steps / 2) * kv_token  # the mean context over the timed steps
            bound_s = (weight_bytes + kv_bytes) / bw
            rows.append({"batch": b, "engine_step_ms": core_s * 1e3, "generate_step_ms": hf_s * 1e3,
                         "bound_ms": bound_s * 1e3, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes})  # fmt: skip
            print(f"  batch {b:>3}: engine core {core_s * 1e3:7.2f} ms/step ({core_s / bound_s:5.1f}x the bound), "
                  f"model.generate {hf_s * 1e3:7.2f} ms/step ({hf_s / bound_s:5.1f}x), bound {bound_s * 1e3:.3f} ms "
                  f"(weights {weight_bytes / 1e6:.0f} MB + KV {kv_bytes / 1e6:.0f} MB)", flush=True)  # fmt: skip
    report.write_json(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "model_path": path, "rows": rows})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""The decode attention of one engine step on this machine, formulation against formulation: what
``PagedKVCache.attention`` should do for B one-token decodes over a paged KV cache of mixed lengths.

  native       the C kernel reading the blocks in place, all decodes in one call (the CPU path, native.py)
  per-seq      one SDPA call per sequence over its KV gathered block by block (the CPU path without a compiler)
  per-seq-slot per-seq, gathering slot by slot with advanced indexing (the CPU path before)
  padded       one gather into [B, Lmax] + one masked SDPA call (the GPU path)
  padded-mm    the same gather, attention as two batched matmuls + softmax (no SDPA)
  per-seq-bf16 per-seq with the cache and queries in bfloat16
  compiled     ``torch.compile`` of padded (with --compile; inductor needs a C++ compiler)

SmolLM2-135M's attention shape by default (9 query heads, 3 KV heads, head dim 64, 30 layers), blocks of 16
scattered over the pool. Prints the time per layer and per step (x layers), best of --repeat; one layer's
cache is reused, so its memory is warmer than in a real step.

    .venv/bin/python -m bench.studies.attention --batch 8,32 --threads 2
    .venv/bin/python -m bench.studies.attention --batch 8,32 --threads 1 --isa avx2,avx512   # each ISA's kernel
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.studies import isa as study_isa
from zserve.generator.native import decode_kernel


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="8,32")
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=768)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--out", default="", help="a JSON file for the figures")
    study_isa.add_argument(p)
    return p.parse_args(argv)


def best_ms(fn: Callable[[], object], repeat: int) -> float:
    # one thread: the thread's CPU time (other processes on a shared machine do not count); more: the wall clock
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best * 1000


def measure(batch: int, args: argparse.Namespace, rng: random.Random) -> dict[str, float]:
    lengths = [rng.randint(args.min_len, args.max_len) for _ in range(batch)]
    bs = args.block_size
    num_blocks = sum(-(-n // bs) for n in lengths) + 4
    kc = torch.randn(num_blocks * bs, args.kv_heads, args.head_dim)
    vc = torch.randn_like(kc)
    perm = torch.randperm(num_blocks).to(torch.int32)  # blocks are scattered over the pool
    tables, rows, offset = [], [], 0
    for n in lengths:
        tables.append(perm[offset : offset + -(-n // bs)])
        rows.append((tables[-1].long().view(-1, 1) * bs + torch.arange(bs)).view(-1)[:n])
        offset += len(tables[-1])
    table_tensor = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)
    length_tensor = torch.tensor(lengths, dtype=torch.int32)
    kernel = decode_kernel(kc)
    q = torch.randn(1, args.heads, batch, args.head_dim)
    padded = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    mask = (torch.arange(padded.shape[1]).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).view(batch, 1, 1, -1)
    group = args.heads // args.kv_heads

    def per_seq_slot(kc=kc, vc=vc, q=q) -> torch.Tensor:
        out = torch.empty_like(q)
        for i, slots in enumerate(rows):
            out[:, :, i : i + 1] = F.scaled_dot_product_attention(
                q[:, :, i : i + 1],
                kc[slots].transpose(0, 1).unsqueeze(0),
                vc[slots].transpose(0, 1).unsqueeze(0),
                enable_gqa=True,
            )
        return out

    def per_seq(kc=kc, vc=vc, q=q) -> torch.Tensor:
        out = torch.empty_like(q)
        kb, vb = kc.view(-1, bs, *kc.shape[1:]), vc.view(-1, bs, *vc.shape[1:])
        for i, (table, n) in enumerate(zip(tables, lengths, strict=True)):
            keys = kb.index_select(0, table).flatten(0, 1)[:n].transpose(0, 1).unsqueeze(0)
            values = vb.index_select(0, table).flatten(0, 1)[:n].transpose(0, 1).unsqueeze(0)
            out[:, :, i : i + 1] = F.scaled_dot_product_attention(q[:, :, i : i + 1], keys, values, enable_gqa=True)
        return out

    def native(kc=kc, vc=vc, q=q) -> torch.Tensor:
        out = torch.empty_like(q)
        kernel(q[0].transpose(0, 1), kc, vc, table_tensor, length_tensor, bs, args.head_dim**-0.5,
               out[0].transpose(0, 1))  # fmt: skip
        return out

    def padded_sdpa(kc=kc, vc=vc, q=q) -> torch.Tensor:
        keys = kc[padded].permute(0, 2, 1, 3)
        values = vc[padded].permute(0, 2, 1, 3)
        queries = q[0].transpose(0, 1).unsqueeze(2)
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=True)

    def padded_mm(kc=kc, vc=vc, q=q) -> torch.Tensor:
        keys = kc[padded].permute(0, 2, 3, 1)  # [B, Hkv, D, L]
        values = vc[padded].permute(0, 2, 1, 3)  # [B, Hkv, L, D]
        queries = q[0].transpose(0, 1).reshape(batch, args.kv_heads, group, args.head_dim)
        scores = (queries @ keys) * args.head_dim**-0.5  # [B, Hkv, group, L]
        scores = scores.masked_fill(~mask.view(batch, 1, 1, -1), float("-inf"))
        return torch.softmax(scores, -1) @ values

    kb, vb, qb = kc.bfloat16(), vc.bfloat16(), q.bfloat16()
    variants: dict[str, Callable[[], object]] = {
        "per-seq": per_seq,
        "per-seq-slot": per_seq_slot,
        "padded": padded_sdpa,
        "padded-mm": padded_mm,
        "per-seq-bf16": lambda: per_seq(kb, vb, qb),
    }
    if kernel is not None:
        variants["native"] = native
        assert torch.allclose(per_seq(), native(), atol=1e-4), "the kernel disagrees"
    if args.compile:
        variants["compiled"] = torch.compile(padded_sdpa, dynamic=False)
    ref = per_seq()[0].transpose(0, 1)
    check = padded_sdpa().squeeze(2)
    assert torch.allclose(ref, check, atol=1e-4), "the formulations disagree"
    print(f"B={batch}, KV lengths {min(lengths)}-{max(lengths)} (sum {sum(lengths)}):")
    times = {}
    for name, fn in variants.items():
        times[name] = ms = best_ms(fn, args.repeat)
        print(f"  {name:<13} {ms:7.2f} ms per layer, {ms * args.layers:7.1f} ms per step", flush=True)
    return times


def main() -> None:
    argv = sys.argv[1:]
    args = parse_args(argv)
    out = Path(args.out or "/tmp/zserve-attention.json")
    results = study_isa.delegate("bench.studies.attention", argv, study_isa.parse(args.isa), out)
    if results is not None:
        print("\nside by side (ms per layer):")
        for isa, data in results:
            for batch, times in data["batches"].items():
                print(f"  {isa:<9} B={batch:<4} " + "  ".join(f"{k} {v:.2f}" for k, v in times.items()))
        return
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    print(f"{study_isa.cpu()}\n{study_isa.describe()}")
    print(f"torch {torch.__version__}, {args.threads} threads; heads {args.heads}/{args.kv_heads} x {args.head_dim}")
    batches = {b: measure(b, args, rng) for b in (int(b) for b in args.batch.split(","))}
    if args.out:
        Path(args.out).write_text(json.dumps({"cpu": study_isa.cpu(), "isa": study_isa.describe(), "batches": batches}))


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""The GPU smoke, about a minute, before the longer checks (bench/gpu/device_run.sh runs it first):

1. triton: a vector add jitted and run on the device;
2. the paged attention kernel (zserve/generator/triton_attention.py) in bf16 at head dims 64 and 128, KV blocks
   of 16, against torch's SDPA over the same keys gathered per sequence: decodes split over their keys (batch
   1) and unsplit (batch 64), and a prefill chunk after cached keys; the error and the time of one call;
3. a bf16 tiny Llama in the engine core with CUDA graphs: graphs captured, replays counted, the first replay's
   check against the eager step passed, greedy tokens equal to the same engine without graphs.

    python -m bench.gpu.smoke --out smoke.json          # on the GPU
    TRITON_INTERPRET=1 ZSERVE_TRITON_ATTENTION=interpret python -m bench.gpu.smoke --dry   # the CPU, interpreted

Every part runs whatever the others did; the JSON is rewritten after each; the exit status is 1 when any failed.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

BF16_TOLERANCE = 2e-2  # of the largest output magnitude: bf16 rounds its inputs and the probabilities


def triton_add(device: str) -> dict:
    import triton
    import triton.language as tl

    @triton.jit
    def add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < n) + tl.load(y_ptr + i, mask=i < n), mask=i < n)

    x, y = torch.randn(1000, device=device), torch.randn(1000, device=device)
    out = torch.empty_like(x)
    add[(4,)](x, y, out, 1000, BLOCK=256)
    ok = bool(torch.equal(out, x + y))
    return {"ok": ok, "triton": triton.__version__}


def attention(device: str, head_dim: int, decodes: int, dry: bool) -> dict:
    from zserve.generator import triton_attention

    bs, kv_heads, heads = 16, 3, 9  # SmolLM2-135M's GQA (3 query heads per KV head)
    g = torch.Generator().manual_seed(head_dim + decodes)
    context, chunk = (20, 20) if dry else (512, 40)
    lengths = [context + 7 * i for i in range(decodes)] + [context + chunk]
    rows = [1] * decodes + [chunk]  # the decodes, then a prefill chunk after `context` cached keys
    blocks = [-(-n // bs) for n in lengths]
    perm = torch.randperm(sum(blocks), generator=g)
    tables, at = [], 0
    for n in blocks:
        tables.append(perm[at : at + n].to(torch.int32))
        at += n
    dtype = torch.bfloat16
    k, v = (torch.randn(sum(blocks) * bs, kv_heads, head_dim, generator=g).to(dtype).to(device) for _ in range(2))
    row_seq = [s for s, n in enumerate(rows) for _ in range(n)]
    row_pos = [lengths[s] - rows[s] + i for s, n in enumerate(rows) for i in range(n)]
    q = torch.randn(len(row_seq), heads, head_dim, generator=g).to(dtype).to(device)
    query_start = [sum(rows[:i]) for i in range(len(rows) + 1)]
    args = (q, k, v, torch.nn.utils.rnn.pad_sequence(tables, batch_first=True).to(device),
            torch.tensor(row_seq, dtype=torch.int32, device=device), torch.tensor(row_pos, device=device), bs,
            head_dim**-0.5, decodes, triton_attention.prefill_tiles(query_start, decodes).to(device))  # fmt: skip
    out = triton_attention.paged_attention(*args)
    call_us = None  # interpreted, a time says nothing
    if not dry:
        _sync(device)
        started = time.perf_counter()
        for _ in range(50):
            triton_attention.paged_attention(*args)
        _sync(device)
        call_us = (time.perf_counter() - started) / 50 * 1e6
    worst = 0.0
    for s, n in enumerate(rows):  # SDPA per sequence, over its keys gathered from the blocks, causal to its rows
        first = query_start[s]
        slots = (tables[s].long().unsqueeze(1) * bs + torch.arange(bs)).flatten()[: lengths[s]].to(device)
        keys, values = k[slots].transpose(0, 1).unsqueeze(0), v[slots].transpose(0, 1).unsqueeze(0)
        mask = torch.arange(lengths[s], device=device)[None, :] <= torch.tensor(row_pos[first : first + n],
                                                                                 device=device)[:, None]  # fmt: skip
        expected = F.scaled_dot_product_attention(q[first : first + n].transpose(0, 1).unsqueeze(0), keys, values,
                                                  attn_mask=mask, scale=head_dim**-0.5, enable_gqa=True)  # fmt: skip
        expected = expected[0].transpose(0, 1).float()
        err = ((out[first : first + n].float() - expected).abs().max() / expected.abs().max()).item()
        worst = max(worst, err)
    split = decodes * kv_heads < triton_attention.FULL_GRID
    return {"head_dim": head_dim, "block_size": bs, "decodes": decodes, "split_kv": split, "prefill_rows": chunk,
            "context": context, "max_error": worst, "call_us": call_us, "ok": worst <= BF16_TOLERANCE}  # fmt: skip


def graphs(device: str, dry: bool) -> dict:
    from bench.gpu.gen_check import TINY, build
    from zserve.generator.llama import own_model
    from zserve.generator.sequence import SamplingParams
    from zserve.generator.step_core import StepCore

    reference = build("Llama", dict(TINY, num_attention_heads=4, num_key_value_heads=2), torch.bfloat16, device)
    produced = {}
    made = None
    for graphed in (False, True):
        core = StepCore(own_model(copy.deepcopy(reference), "zserve"), num_blocks=64, block_size=16,
                        max_batched_tokens=256, max_running=4 if dry else 8, batched_decode=True, native_decode=False,
                        cuda_graphs=graphed)  # fmt: skip
        made = core.graphs if graphed else made
        out: dict[int, list[int]] = {}
        for i in range(2 if dry else 3):
            prompt = [(11 * i + j) % 200 + 5 for j in range(5 + 9 * i)]
            core.add(i, prompt, SamplingParams(max_new_tokens=4 if dry else 8))
        while core.has_work():
            for o in core.step():
                out.setdefault(o.seq_id, []).append(o.token_id)
        produced[graphed] = out
    return {"graphs": made is not None, "replays": made.replays if made else 0,
            "graph_check": made.passed if made else None, "graph_error": made.error if made else None,
            "greedy_equal_eager": produced[True] == produced[False],
            "ok": bool(made and made.replays > 0 and made.passed)}  # fmt: skip


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry", action="store_true", help="on the CPU, through triton's interpreter, tiny sizes")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    from bench.gpu.gen_check import _import_zserve

    _import_zserve()
    device = "cpu" if args.dry else "cuda"
    if not args.dry and not torch.cuda.is_available():
        sys.exit("smoke.py: no CUDA device (use --dry on a CPU)")
    torch.set_grad_enabled(False)
    if args.dry:  # the interpreter runs every program in Python: split decodes in 2, not 16
        from zserve.generator import triton_attention

        triton_attention.SPLITS = 2
    started = time.perf_counter()
    result: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry)", "parts": {}}
    parts = {"triton": lambda: triton_add(device)}
    for d in (64, 128):
        for decodes in (1, 3 if args.dry else 64):
            parts[f"attention bf16 d{d} decodes{decodes}"] = lambda d=d, n=decodes: attention(device, d, n, args.dry)
    parts["cuda graphs bf16"] = lambda: graphs(device, args.dry)
    failed = []
    for name, part in parts.items():
        t0 = time.perf_counter()
        try:
            out = part()
        except Exception as exc:
            traceback.print_exc()
            out = {"ok": False, "error": repr(exc)}
        out["seconds"] = time.perf_counter() - t0
        result["parts"][name] = out
        print(f"smoke {name}: {out}", flush=True)
        if not out["ok"]:
            failed.append(name)
        result["wall_s"] = time.perf_counter() - started
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1))
    print(f"smoke done in {result['wall_s']:.0f} s" + (f"; FAILED: {failed}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

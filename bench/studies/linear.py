#!/usr/bin/env python
"""The linear products of one engine step on this machine: the layers the engine runs (SmolLM2's by default:
per decoder layer the merged q/k/v, o, the merged gate/up and down, as ``llama.py`` merges them at load, each
with its own weight, so the weights stream from memory as in a real step; and the ``lm_head`` at up to
--head-rows rows, the most the engine computes logits for), on R rows through

  torch     ``nn.Linear`` as loaded (MKL for fp32 on a CPU)
  onednn    ``cpu_linear.PackedLinear``, the weight reordered once for oneDNN (``cpu_linear = "onednn"``)
  <variant> our C kernel with one of its schedules for this ISA (``native_linear.variants``: 8x3, 6x2, ...),
            the weight packed once
  chosen    what ``cpu_linear = "auto"`` runs: per shape and row bucket the fastest of the above as
            ``kernel_tune`` measured it at start (the buckets: --rows; the one log line it writes is printed)
  torch-bf16 / onednn-bf16  torch and oneDNN with the weights and inputs in bfloat16 (onednn-bf16 skipped, with
            the reason, on a CPU whose oneDNN refuses bf16: no AVX-512 bw/vl/dq nor AVX-NE-CONVERT)

Prints ms per step (every product once), best of --repeat (at 1 thread the thread's CPU time, else the wall
clock), and chosen's speed against oneDNN's. ``--isa
avx2,avx512`` measures each ISA in its own process, our kernels built for it and oneDNN/MKL/ATen capped to it
(``bench/studies/isa.py``), and prints them side by side.

    .venv/bin/python -m bench.studies.linear --rows 1,8,32,256 --threads 1 --isa avx2,avx512
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

from bench.common import report
from bench.common.paths import RESULTS
from bench.generation import zserve_leg
from bench.studies import isa as study_isa


def _merged(model):
    """The engine's products from a Hugging Face Llama: q/k/v and gate/up merged per layer, as ``llama.py``."""
    import torch
    from torch import nn

    def cat(*parts):
        w = torch.cat([p.weight.detach() for p in parts])
        out = nn.Linear(w.shape[1], w.shape[0], bias=parts[0].bias is not None, dtype=w.dtype)
        out.weight = nn.Parameter(w, requires_grad=False)
        if parts[0].bias is not None:
            out.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
        return out

    layers = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        layers += [cat(a.q_proj, a.k_proj, a.v_proj), a.o_proj, cat(m.gate_proj, m.up_proj), m.down_proj]
    return layers


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="a transformers folder, smollm2 or tiny (default %(default)s)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rows", default="1,8,32,256", help="rows per product (default %(default)s)")
    p.add_argument("--head-rows", type=int, default=64, help="the lm_head's rows at most (default %(default)s)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="the bf16 legs too")
    p.add_argument("--out", type=Path, default=RESULTS / "issue33-linear.json")
    study_isa.add_argument(p)
    args = p.parse_args(argv)
    rows_list = [int(x) for x in args.rows.split(",") if x]
    results = study_isa.delegate("bench.studies.linear", argv, study_isa.parse(args.isa), args.out)
    if results is not None:
        _side_by_side(results, rows_list)
        report.write_json(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "cpu": study_isa.cpu(),
                                     "isas": dict(results)})  # fmt: skip
        return 0

    import torch
    from torch import nn
    from transformers import AutoModelForCausalLM

    from zserve.generator import c_build, cpu_linear, kernel_tune, native_linear

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("zserve.engine").setLevel(logging.INFO)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="zserve-linear-") as tmp:
        path = zserve_leg.resolve_model(args.model, args.dtype, Path(tmp))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype))
    head = model.get_output_embeddings()
    plain = [*_merged(model), head]
    print(study_isa.cpu())
    print(f"{study_isa.describe()}; torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()})")
    print(f"{path}: {len(plain)} products, {sum(m.weight.numel() for m in plain) / 1e6:.1f} M weights, "
          f"{args.dtype}, {args.threads} thread(s); the lm_head up to {args.head_rows} rows")  # fmt: skip

    isa = c_build.isa().name
    legs: dict[str, list] = {"torch": plain, "onednn": [cpu_linear.PackedLinear(m, native=False) for m in plain]}
    variant0 = native_linear.default(isa)
    if native_linear.applies(plain[0].weight, variant0):
        packs = [native_linear.pack(m.weight, variant0) if native_linear.applies(m.weight, variant0) else None
                 for m in plain]  # fmt: skip
        for v in native_linear.variants(isa):
            legs[v.name] = [_NativeLeg(m, w, v) if w is not None else legs["onednn"][i]
                            for i, (m, w) in enumerate(zip(plain, packs, strict=True))]  # fmt: skip
    else:
        print(f"our kernel does not build for {isa} here: its legs skipped")
    t0 = time.perf_counter()
    routes = kernel_tune.choose(plain, tuple(rows_list), head, args.head_rows)
    print(f"(the choice took {time.perf_counter() - t0:.1f} s, its cache included)")
    legs["chosen"] = [cpu_linear.PackedLinear(m, route=routes[kernel_tune.shape(m)]) if kernel_tune.shape(m) in routes
                      else cpu_linear.PackedLinear(m) for m in plain]  # fmt: skip
    if args.bf16:
        plain_bf16 = [nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, dtype=torch.bfloat16)
                      for m in plain]  # fmt: skip
        legs["torch-bf16"] = plain_bf16
        if cpu_linear.packs(torch.bfloat16):
            legs["onednn-bf16"] = [cpu_linear.PackedLinear(m, native=False) for m in plain_bf16]
        else:
            print("onednn-bf16 skipped: oneDNN refuses bf16 on this CPU (it needs AVX-512 bw/vl/dq or AVX-NE-CONVERT)")

    # one thread: the thread's CPU time (all the work runs on it, and other processes on a shared machine do
    # not count, as in bench.studies.step); more: the wall clock
    clock = time.thread_time if args.threads == 1 else time.perf_counter

    def step_ms(layers: list, inputs: dict[int, torch.Tensor], r: int) -> float:
        used = [m for m, base in zip(layers, plain, strict=True) if base is not head or r <= args.head_rows]
        best = float("inf")
        with torch.inference_mode():
            for _ in range(args.repeat):
                t0 = clock()
                for layer in used:
                    layer(inputs[layer.in_features])
                best = min(best, clock() - t0)
        return best * 1e3

    rows = []
    print(f"  {'rows':>5} " + " ".join(f"{name:>11}" for name in legs) + "  chosen vs onednn")
    for r in rows_list:
        inputs = {m.in_features: torch.randn(r, m.in_features, dtype=model.dtype) for m in plain}
        inputs_bf16 = {k: x.bfloat16() for k, x in inputs.items()}
        row = {"rows": r}
        for name, layers in legs.items():  # warm up every leg, then time them in turn
            step_ms(layers, inputs_bf16 if name.endswith("bf16") else inputs, 1 if r > 1 else r)
        for name, layers in legs.items():
            row[f"{name}_ms"] = step_ms(layers, inputs_bf16 if name.endswith("bf16") else inputs, r)
        row["chosen_speedup"] = row["onednn_ms"] / row["chosen_ms"]
        rows.append(row)
        cells = " ".join(f"{row[f'{name}_ms']:11.1f}" for name in legs)
        print(f"  {r:>5} {cells}  {row['chosen_speedup']:.2f}x", flush=True)
    report.write_json(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "cpu": study_isa.cpu(),
                                 "isa": study_isa.describe(), "legs": list(legs), "rows": rows})  # fmt: skip
    print(f"wrote {args.out}")
    return 0


class _NativeLeg:
    """One product through our kernel with one schedule, on a packing the variants of an ISA share."""

    def __init__(self, linear, packed, variant) -> None:
        self.in_features, self.packed, self.variant = linear.in_features, packed, variant
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()

    def __call__(self, x):
        from zserve.generator import native_linear

        return native_linear.linear(x, self.packed, self.bias, self.variant)


def _side_by_side(results: list[tuple[str, dict]], rows_list: list[int]) -> None:
    """Per row count, each ISA's torch, oneDNN, best variant and chosen (ms), and chosen against oneDNN."""
    print("\nside by side (ms per step; chosen vs onednn as speed):")
    header = f"  {'rows':>5}"
    for isa, _ in results:
        header += f" | {isa + ' torch':>14} {'onednn':>8} {'best ours':>16} {'chosen':>8} {'vs onednn':>9}"
    print(header)
    for r in rows_list:
        line = f"  {r:>5}"
        for _, data in results:
            row = next((x for x in data["rows"] if x["rows"] == r), None)
            if row is None:
                line += " | (not measured)"
                continue
            ours = {k[:-3]: v for k, v in row.items() if k.endswith("_ms") and k[:-3] not in
                    ("torch", "onednn", "chosen", "torch-bf16", "onednn-bf16")}  # fmt: skip
            best = min(ours, key=ours.get) if ours else "-"
            best_cell = f"{best} {ours[best]:.1f}" if ours else "-"
            line += (f" | {row['torch_ms']:14.1f} {row['onednn_ms']:8.1f} {best_cell:>16} {row['chosen_ms']:8.1f}"
                     f" {row['chosen_speedup']:8.2f}x")  # fmt: skip
        print(line)


if __name__ == "__main__":
    sys.exit(main())

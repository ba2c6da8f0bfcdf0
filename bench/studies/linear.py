#!/usr/bin/env python
"""The linear layers of one engine step on this machine: the model's own ``nn.Linear`` modules (every
layer's q/k/v/o and MLP projections, and the ``lm_head``, each with its own weight, so the weights stream
from memory as in a real step), run on R rows through

  torch   ``nn.Linear`` as loaded (MKL for fp32 on a CPU)
  onednn  ``cpu_linear.PackedLinear``, the weight reordered once for oneDNN (``cpu_linear = "onednn"``)
  native  ``cpu_linear.PackedLinear`` on our C kernel, the weight packed once (the engine's CPU default for
          fp32; a layer the kernel does not take, or a machine without a C compiler, runs oneDNN)
  torch-bf16 / onednn-bf16  the same with the weights and inputs in bfloat16 (``dtype = "bfloat16"``)

Prints ms per step (every linear layer once) and the ratio, best of --repeat.

    .venv/bin/python -m bench.studies.linear --rows 1,2,4,8,16,32,64,256 --threads 1
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from bench.common import report
from bench.common.paths import RESULTS
from bench.generation import zserve_leg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="a transformers folder, smollm2 or tiny (default %(default)s)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rows", default="1,2,4,8,16,32,64,256", help="rows per product (default %(default)s)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", type=Path, default=RESULTS / "issue10-linear.json")
    args = p.parse_args(argv)

    import torch
    from torch import nn
    from transformers import AutoModelForCausalLM

    from zserve.generator import cpu_linear

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="zserve-linear-") as tmp:
        path = zserve_leg.resolve_model(args.model, args.dtype, Path(tmp))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype))
    plain = [m for m in model.modules() if type(m) is nn.Linear]
    packed = [cpu_linear.PackedLinear(m, native=False) for m in plain]
    native = [cpu_linear.PackedLinear(m) for m in plain]
    plain_bf16 = [nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, dtype=torch.bfloat16)
                  for m in plain]  # fmt: skip
    packed_bf16 = [cpu_linear.PackedLinear(m, native=False) for m in plain_bf16]
    print(f"native kernel on {sum(m.native for m in native)} of {len(native)} layers")
    print(f"{path}: {len(plain)} linear layers, {sum(m.weight.numel() for m in plain) / 1e6:.1f} M weights, "
          f"{args.dtype}, {args.threads} thread(s)")  # fmt: skip

    def step_ms(layers: list, inputs: dict[int, torch.Tensor]) -> float:
        best = float("inf")
        with torch.inference_mode():
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                for layer in layers:
                    layer(inputs[layer.in_features])
                best = min(best, time.perf_counter() - t0)
        return best * 1e3

    rows = []
    for r in (int(x) for x in args.rows.split(",") if x):
        inputs = {m.in_features: torch.randn(1, r, m.in_features, dtype=model.dtype) for m in plain}
        inputs_bf16 = {k: x.bfloat16() for k, x in inputs.items()}
        legs = {"torch": (plain, inputs), "onednn": (packed, inputs), "native": (native, inputs),
                "torch-bf16": (plain_bf16, inputs_bf16), "onednn-bf16": (packed_bf16, inputs_bf16)}  # fmt: skip
        for layers, x in legs.values():  # warm up every leg
            step_ms(layers, x)
        row = {"rows": r} | {f"{name}_ms": step_ms(layers, x) for name, (layers, x) in legs.items()}
        rows.append(row)
        cells = "  ".join(f"{name} {row[f'{name}_ms']:7.1f}" for name in legs)
        print(f"  {r:>4} rows (ms): {cells}  native/onednn {row['native_ms'] / row['onednn_ms']:.2f}", flush=True)
    report.write_json(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

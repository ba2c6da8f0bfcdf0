#!/usr/bin/env python
"""The linear layers of one engine step on this machine: the model's own ``nn.Linear`` modules (every
layer's q/k/v/o and MLP projections, and the ``lm_head``, each with its own weight, so the weights stream
from memory as in a real step), run on R rows through

  torch   ``nn.Linear`` as loaded (MKL for fp32 on a CPU)
  onednn  ``cpu_linear.PackedLinear``, the weight reordered once for oneDNN (the engine's CPU default)

Prints ms per step (every linear layer once) and the ratio, best of --repeat.

    .venv/bin/python bench/gen_linear.py --rows 1,2,4,8,16,32,64,256 --threads 1
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import gen_zserve
import report
from bench_paths import RESULTS


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

    from zserve.stages.generate import cpu_linear

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="zserve-linear-") as tmp:
        path = gen_zserve.resolve_model(args.model, args.dtype, Path(tmp))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype))
    plain = [m for m in model.modules() if type(m) is nn.Linear]
    packed = [cpu_linear.PackedLinear(m) for m in plain]
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
        step_ms(plain, inputs)  # warm up both
        step_ms(packed, inputs)
        torch_ms, onednn_ms = step_ms(plain, inputs), step_ms(packed, inputs)
        rows.append({"rows": r, "torch_ms": torch_ms, "onednn_ms": onednn_ms})
        print(f"  {r:>4} rows: torch {torch_ms:7.1f} ms  onednn {onednn_ms:7.1f} ms  "
              f"onednn/torch {onednn_ms / torch_ms:.2f}", flush=True)  # fmt: skip
    report.write_json(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""The generative engine's GPU check, in one run of a few minutes on one CUDA device, with random weights from
real configs (nothing downloaded) and our Llama-family model code (zserve/generator/llama.py):

1. parity: greedy output of the engine core (decodes as one padded batch, the step's inputs in one packed
   upload, as on any GPU) equals Hugging Face ``generate`` on the same device, token for token, for tiny
   Llama (GQA), Qwen2 (q/k/v bias, tied) and Qwen3 (q/k norm) configs in fp32 (TF32 off);
2. the decode step at batch 1/8/32/64 (prompts of ``--prompt`` tokens) for SmolLM2-135M's and Qwen3-0.6B's
   shapes in bf16: its median time against the memory-bandwidth bound, (weight bytes + KV bytes read) /
   bandwidth, the bandwidth measured here by a device-to-device copy;
3. per decode step (batch 8): kernels launched and host syncs (``cuda*Synchronize`` calls), from the profiler.
Parts 1-3 run for each leg: ``triton+graphs`` (decode steps replay CUDA graphs, zserve/generator/cuda_graphs.py,
over the Triton kernel), ``triton`` (zserve/generator/triton_attention.py eagerly: every row of the step in one
kernel per layer, over the blocks in place) and ``torch`` (decodes as one padded SDPA batch over gathered KV,
prefill chunks one SDPA call each).

    python -m bench.gpu.gen_check --out bench/results/issue25-gen-gpu.json   # on the lent machine
    python -m bench.gpu.gen_check --dry                                       # CPU, tiny shapes, seconds

``--dry`` runs every part on the CPU at tiny sizes (the CPU suite runs it, so that the script cannot rot).
It needs torch, transformers and zserve's importable tree (``python -m`` from the repo root is enough: zserve's
subpackages are mapped here when it is not installed), plus zserve's pure-Python dependencies.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def _import_zserve() -> None:
    """zserve's stages/, broker/, frontends/ are its subpackages by pyproject's package-dir mapping: without an
    install, map them by path."""
    import zserve

    if str(REPO) not in zserve.__path__:
        zserve.__path__.append(str(REPO))


SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    tie_word_embeddings=True, rope_theta=100000.0)  # fmt: skip
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 tie_word_embeddings=True)  # fmt: skip
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=512)
PARITY = {
    "llama-gqa": ("Llama", dict(TINY, num_attention_heads=4, num_key_value_heads=2)),
    "qwen2-tied": ("Qwen2", dict(TINY, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3-qknorm": ("Qwen3", dict(TINY, num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
}


def build(prefix: str, shape: dict, dtype: torch.dtype, device: str):
    import transformers

    config = getattr(transformers, f"{prefix}Config")(**shape, eos_token_id=None, bos_token_id=None, pad_token_id=0,
                                                      initializer_range=0.1)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, f"{prefix}ForCausalLM")(config)
    return model.to(dtype).eval()


def gpu_path_core(model, num_blocks: int, max_batched_tokens: int, dry: bool, graphs: bool):
    from zserve.generator.attention import Uploader
    from zserve.generator.step_core import StepCore

    core = StepCore(model, num_blocks=num_blocks, block_size=16, max_batched_tokens=max_batched_tokens,
                    max_running=8 if dry else 256, batched_decode=True, native_decode=False,
                    cuda_graphs=graphs)  # fmt: skip
    if graphs:
        assert core.graphs is not None, "CUDA graphs asked for, and the engine did not build them"
    if dry:
        core.upload = Uploader(core.device, pack=True)  # what a device runs
    return core


def parity(device: str, dry: bool, graphs: bool) -> dict:
    from zserve.generator.llama import own_model
    from zserve.generator.sequence import SamplingParams

    out = {}
    rng = random.Random(1)
    for name, (prefix, shape) in PARITY.items():
        reference = build(prefix, shape, torch.float32, device)
        core = gpu_path_core(own_model(copy.deepcopy(reference), "zserve"), 64, 64, dry, graphs)
        prompts = [[rng.randrange(1, 256) for _ in range(rng.randrange(3, 90))] for _ in range(8)]
        produced: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            core.add(i, p, SamplingParams(max_new_tokens=12))
        while core.has_work():
            for o in core.step():
                produced.setdefault(o.seq_id, []).append(o.token_id)
        equal = 0
        for i, p in enumerate(prompts):
            ids = torch.tensor([p], device=device)
            ref = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                                     do_sample=False, pad_token_id=0)[0, len(p) :].tolist()  # fmt: skip
            equal += produced[i] == ref
        out[name] = f"{equal}/{len(prompts)}"
        print(f"parity {name}: {equal}/{len(prompts)} sequences equal generate", flush=True)
    return out


def bandwidth_gbs(device: str, dry: bool) -> float:
    n = (64 << 20) if dry else (2 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    _sync(device)
    return 2 * n * 5 / (time.perf_counter() - t0) / 1e9  # read + write


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def decode_steps(name: str, prefix: str, shape: dict, device: str, dtype, batches, prompt, steps, bw, dry, graphs):
    from zserve.generator.llama import own_model
    from zserve.generator.sequence import SamplingParams
    from zserve.generator.step_core import head_dim, kv_heads

    model = own_model(build(prefix, shape, dtype, device), "zserve")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    c = model.config
    kv_per_token = 2 * c.num_hidden_layers * kv_heads(c) * head_dim(c) * torch.tensor([], dtype=dtype).element_size()
    per_seq_blocks = -(-(prompt + steps + 8) // 16) + 1
    core = gpu_path_core(model, per_seq_blocks * max(batches), max(2048, prompt), dry, graphs)
    rows = []
    for b in batches:
        for i in range(b):
            core.add(i, [(7 * i + j) % 1000 + 10 for j in range(prompt)], SamplingParams(max_new_tokens=steps + 8))
        while any(s.num_computed < prompt for s in core.sequences.values()) or core.stats.batch_tokens != b:
            core.step()
        times = []
        for _ in range(steps):
            _sync(device)
            t0 = time.perf_counter()
            core.step()  # ends in the sampled tokens' copy to the host: the step is done when it returns
            times.append(time.perf_counter() - t0)
        for i in range(b):
            core.abort(i)
        step_s = statistics.median(times)
        bound_s = (weight_bytes + b * (prompt + steps / 2) * kv_per_token) / (bw * 1e9)
        rows.append({"model": name, "batch": b, "step_ms": step_s * 1e3, "bound_ms": bound_s * 1e3,
                     "bound_fraction": bound_s / step_s})  # fmt: skip
        print(f"{name} batch {b:>3}: step {step_s * 1e3:8.3f} ms, bound {bound_s * 1e3:7.3f} ms "
              f"({bound_s / step_s:.2f} of it)", flush=True)  # fmt: skip
    return core, rows


def kernels_and_syncs(core, device: str, batch: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from zserve.generator.sequence import SamplingParams

    for i in range(batch):
        core.add(i, [5 + i] * 32, SamplingParams(max_new_tokens=16))
    while any(s.num_computed < 32 for s in core.sequences.values()):
        core.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    steps = 3
    with profile(activities=activities) as prof:
        for _ in range(steps):
            core.step()
    events = prof.events()
    kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    syncs = sum(1 for e in events if "Synchronize" in e.name)
    ops = sum(1 for e in events if e.name.startswith("aten::"))
    for i in range(batch):
        core.abort(i)
    out = {"batch": batch, "kernels_per_step": kernels / steps, "syncs_per_step": syncs / steps,
           "aten_ops_per_step": ops / steps}  # fmt: skip
    print(f"per decode step at batch {batch}: {out}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry", action="store_true", help="on the CPU, tiny shapes (what the test suite runs)")
    p.add_argument("--batch", default="1,8,32,64")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    _import_zserve()
    device = "cpu" if args.dry else "cuda"
    if not args.dry and not torch.cuda.is_available():
        sys.exit("gen_check.py: no CUDA device (use --dry on a CPU)")
    torch.backends.cuda.matmul.allow_tf32 = False  # parity in fp32 means fp32 products
    torch.set_grad_enabled(False)
    batches = [1, 2] if args.dry else [int(b) for b in args.batch.split(",")]
    prompt, steps = (16, 2) if args.dry else (args.prompt, args.steps)
    started = time.perf_counter()
    result: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry)",
                    "torch": torch.__version__}  # fmt: skip
    from zserve.generator import triton_attention

    # dry: the triton leg runs on the CPU through triton's interpreter when the caller turned it on
    # (TRITON_INTERPRET=1 ZSERVE_TRITON_ATTENTION=interpret, as the test suite does)
    on = triton_attention.MODE
    backends = ["triton+graphs", "triton", "torch"] if triton_attention.usable(torch.device(device)) else ["torch"]
    result["attention_backends"] = backends
    shapes = {"tiny": ("Llama", dict(TINY, num_attention_heads=4, num_key_value_heads=2))} if args.dry else {
        "smollm2-135m": ("Llama", SMOLLM2_135M), "qwen3-0.6b": ("Qwen3", QWEN3_06B)}  # fmt: skip
    dtype = torch.float32 if args.dry else torch.bfloat16
    result["parity"], result["decode"], result["per_step"] = {}, [], []
    with torch.inference_mode():
        bw = bandwidth_gbs(device, args.dry)
        result["bandwidth_gbs"] = bw
        print(f"measured copy bandwidth: {bw:.0f} GB/s", flush=True)
        for backend in backends:
            triton_attention.MODE = on if backend.startswith("triton") else "off"
            graphs = backend == "triton+graphs"
            print(f"-- attention: {backend}", flush=True)
            result["parity"] |= {f"{name} ({backend})": v for name, v in parity(device, args.dry, graphs).items()}
            for name, (prefix, shape) in shapes.items():
                core, rows = decode_steps(name, prefix, shape, device, dtype, batches, prompt, steps, bw, args.dry,
                                          graphs)  # fmt: skip
                result["decode"] += [r | {"attention": backend} for r in rows]
                per_step = kernels_and_syncs(core, device, 2 if args.dry else 8)
                result["per_step"].append({"model": name, "attention": backend} | per_step)
                del core
    result["wall_s"] = time.perf_counter() - started
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    failed = [k for k, v in result["parity"].items() if v.split("/")[0] != v.split("/")[1]]
    print(f"done in {result['wall_s']:.0f} s" + (f"; PARITY FAILED for {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

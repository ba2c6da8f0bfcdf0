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
4. bf16: greedy tokens and logits of SmolLM2-135M's shapes (tiny when dry) in each leg, against the torch leg's.
Parts 1-4 run for each leg, in the order ``torch`` (decodes as one padded SDPA batch over gathered KV, prefill
chunks one SDPA call each), ``triton`` (zserve/generator/triton_attention.py eagerly: the decode rows and the
prefill tiles over the blocks in place) and ``triton+graphs`` (decode steps replay CUDA graphs,
zserve/generator/cuda_graphs.py, over the Triton kernel). Each leg runs in its own try: one that raises prints its
traceback and the next leg runs; the JSON is rewritten after every part. Every row says what ran: the attention
backend (``attention_ran``: the kernel can fail its start-up check and leave the engine on torch), whether graphs
were made and kept, their replays and whether the first replay passed its check against the eager step. On CUDA
the exit status is 1 when a triton leg did not attend through triton or no graph replayed (and on any parity
failure or leg that raised), so a fallback cannot pass for a figure.

    python -m bench.gpu.gen_check --out bench/results/issue25-gen-gpu.json   # on the lent machine
    python -m bench.gpu.gen_check --dry --legs torch                          # CPU, tiny shapes, a minute

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
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def _import_zserve() -> None:
    """zserve from this checkout, installed or not (the GPU image has no install of it)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import zserve  # noqa: F401


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


def gpu_path_core(model, num_blocks: int, max_batched_tokens: int, dry: bool, graphs: bool, max_running: int = 64):
    from zserve.generator.attention import Uploader
    from zserve.generator.step_core import StepCore

    core = StepCore(model, num_blocks=num_blocks, block_size=16, max_batched_tokens=max_batched_tokens,
                    max_running=8 if dry else max_running, batched_decode=True, native_decode=False,
                    cuda_graphs=graphs)  # fmt: skip
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
    core = gpu_path_core(model, per_seq_blocks * max(batches), max(2048, prompt), dry, graphs, max(batches))
    made = core.graphs  # the core drops them if their first replay fails its check
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
    return core, rows, made


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


LEGS = ("torch", "triton", "triton+graphs")  # in this order: the one that cannot fail first


def path_taken(core, made) -> dict:
    """What a leg's engine actually ran: the attention backend of its steps, whether graphs were made (``made``,
    the core's graphs when it was built: the core drops them after a failed check), their replays and check."""
    from zserve.generator import triton_attention

    kernel = triton_attention.MODE != "off" and triton_attention.usable(core.device)
    return {"attention_ran": "triton" if kernel else "torch", "graphs": made is not None,
            "graphs_kept": core.graphs is not None, "replays": made.replays if made else 0,
            "graph_check": made.passed if made else None, "graph_error": made.error if made else None}  # fmt: skip


def bf16_greedy(device: str, dry: bool, graphs: bool) -> dict:
    """Greedy tokens and the logits they came from, for a bf16 model (SmolLM2-135M's shapes; tiny when dry): what
    the legs are compared on (``compare_legs``)."""
    from zserve.generator.llama import own_model
    from zserve.generator.sequence import SamplingParams

    prefix, shape = (
        ("Llama", dict(TINY, num_attention_heads=4, num_key_value_heads=2)) if dry else ("Llama", SMOLLM2_135M)
    )
    core = gpu_path_core(own_model(build(prefix, shape, torch.bfloat16, device), "zserve"), 64, 512, dry, graphs)
    made = core.graphs
    logits: list[torch.Tensor] = []
    sampler = core.sampler

    class Recording:  # the logits each step samples from, before sampling changes them in place
        def run(self, step_logits, seqs):
            logits.append(step_logits.float().cpu().clone())
            return sampler.run(step_logits, seqs)

    core.sampler = Recording()
    tokens: dict[int, list[int]] = {}
    for i in range(4):
        core.add(
            i, [(13 * i + j) % 200 + 5 for j in range(24 + 7 * i)], SamplingParams(max_new_tokens=4 if dry else 16)
        )
    while core.has_work():
        for o in core.step():
            tokens.setdefault(o.seq_id, []).append(o.token_id)
    return {"tokens": tokens, "logits": logits, "path": path_taken(core, made)}


def compare_legs(base: dict, other: dict) -> dict:
    """A leg's bf16 run against the torch leg's: greedy sequences equal, and the largest logit difference over the
    steps both took alike (relative to the largest logit), up to the first step whose tokens differ."""
    equal = sum(base["tokens"][i] == other["tokens"].get(i) for i in base["tokens"])
    worst = 0.0
    for a, b in zip(base["logits"], other["logits"], strict=False):
        if a.shape != b.shape:
            break
        worst = max(worst, float((a - b).abs().max() / a.abs().max().clamp_min(1e-6)))
        if not torch.equal(a.argmax(-1), b.argmax(-1)):
            break
    return {"greedy_equal": f"{equal}/{len(base['tokens'])}", "max_logit_error": worst}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry", action="store_true", help="on the CPU, tiny shapes (what the test suite runs)")
    p.add_argument("--legs", default=",".join(LEGS), help=f"a subset of {','.join(LEGS)}, run in that order")
    p.add_argument("--batch", default="1,8,32,64")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here (after every leg)")
    args = p.parse_args(argv)
    _import_zserve()
    device = "cpu" if args.dry else "cuda"
    if not args.dry and not torch.cuda.is_available():
        sys.exit("gen_check.py: no CUDA device (use --dry on a CPU)")
    torch.backends.cuda.matmul.allow_tf32 = False  # parity in fp32 means fp32 products
    torch.set_grad_enabled(False)
    legs = [leg for leg in LEGS if leg in args.legs.split(",")]
    batches = [1, 2] if args.dry else [int(b) for b in args.batch.split(",")]
    prompt, steps = (16, 2) if args.dry else (args.prompt, args.steps)
    started = time.perf_counter()
    result: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry)",
                    "torch": torch.__version__, "legs": legs, "parity": {}, "decode": [], "per_step": [],
                    "bf16": {}, "paths": {}, "failures": []}  # fmt: skip
    from zserve.generator import llama, triton_attention

    # dry: the triton legs run on the CPU through triton's interpreter when the caller turned it on
    # (TRITON_INTERPRET=1 ZSERVE_TRITON_ATTENTION=interpret, as the test suite does)
    on = triton_attention.MODE
    if args.dry:  # the interpreter runs every program in Python: split decodes in 2, not 16
        triton_attention.SPLITS = 2
    shapes = {"tiny": ("Llama", dict(TINY, num_attention_heads=4, num_key_value_heads=2))} if args.dry else {
        "smollm2-135m": ("Llama", SMOLLM2_135M), "qwen3-0.6b": ("Qwen3", QWEN3_06B)}  # fmt: skip
    dtype = torch.float32 if args.dry else torch.bfloat16
    greedy: dict[str, dict] = {}

    def write() -> None:
        result["wall_s"] = time.perf_counter() - started
        result["compile_s"] = dict(llama.COMPILE_S)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2))

    with torch.inference_mode():
        bw = bandwidth_gbs(device, args.dry)
        result["bandwidth_gbs"] = bw
        print(f"measured copy bandwidth: {bw:.0f} GB/s", flush=True)
        for leg in legs:
            leg_started = time.perf_counter()
            print(f"-- leg {leg}", flush=True)
            try:
                triton_attention.MODE = on if leg.startswith("triton") else "off"
                graphs = leg == "triton+graphs"
                if leg.startswith("triton") and not triton_attention.usable(torch.device(device)):
                    raise RuntimeError("triton attention is not usable here (see the warning above)")
                greedy[leg] = bf16_greedy(device, args.dry, graphs)
                result["paths"][f"bf16 ({leg})"] = greedy[leg]["path"]
                if leg != "torch" and "torch" in greedy:
                    result["bf16"][leg] = compare_legs(greedy["torch"], greedy[leg])
                    print(f"bf16 {leg} against torch: {result['bf16'][leg]}", flush=True)
                write()
                result["parity"] |= {f"{name} ({leg})": v for name, v in parity(device, args.dry, graphs).items()}
                write()
                for name, (prefix, shape) in shapes.items():
                    core, rows, made = decode_steps(name, prefix, shape, device, dtype, batches, prompt, steps, bw,
                                                    args.dry, graphs)  # fmt: skip
                    taken = path_taken(core, made)
                    result["decode"] += [r | {"leg": leg} | taken for r in rows]
                    per_step = kernels_and_syncs(core, device, 2 if args.dry else 8)
                    result["per_step"].append({"model": name, "leg": leg} | per_step | path_taken(core, made))
                    print(f"{name} ({leg}) ran: {path_taken(core, made)}", flush=True)
                    del core, made
                    write()
            except Exception as exc:
                traceback.print_exc()
                result["failures"].append({"leg": leg, "error": repr(exc)})
            print(f"-- leg {leg}: {time.perf_counter() - leg_started:.0f} s", flush=True)
            write()
    print(f"torch.compile, first call of each leaf: {llama.COMPILE_S}", flush=True)
    failed = [k for k, v in result["parity"].items() if v.split("/")[0] != v.split("/")[1]]
    problems = [f"parity failed for {failed}"] if failed else []
    problems += [f"leg {f['leg']} raised {f['error']}" for f in result["failures"]]
    if device == "cuda":  # a GPU run whose fast paths did not run is a failed run, whatever it measured
        ran = [r for r in result["decode"] if r["leg"] != "torch"]
        if any(r["attention_ran"] != "triton" for r in ran) or ("triton" in legs and not ran):
            problems.append("triton attention did not run in a triton leg")
        if "triton+graphs" in legs and not any(r["replays"] for r in ran if r["leg"] == "triton+graphs"):
            problems.append("no CUDA graph replayed in the triton+graphs leg")
    result["problems"] = problems
    write()
    print(f"done in {result['wall_s']:.0f} s" + (f"; FAILED: {problems}" if problems else ""), flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

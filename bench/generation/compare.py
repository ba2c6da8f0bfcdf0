#!/usr/bin/env python
"""Generation benchmark: mixed prompt lengths (16-512 tokens) and output lengths (16-256), closed loop at
several concurrencies, every request ``ignore_eos`` so that it makes exactly its drawn length, for

* zserve  the full deployment (``zserve.serve``: broker + generative engine), streamed through the direct client,
* static  Hugging Face ``model.generate`` on groups formed in a window after the first arrival (left padding,
          as many steps as the longest request of the group),
* single  ``model.generate`` on one request at a time,

reporting output tokens/s, TTFT and TPOT (p50, p99); plus one line: the engine core in process against
``model.generate`` on a uniform batch. Prints a table and the targets, writes JSON (and a PNG plot when
matplotlib is installed).

    .venv/bin/python -m bench.generation                               # SmolLM2-135M, c1,8,32, all legs
    .venv/bin/python -m bench.generation --model tiny --max-prompt 200 --max-output 64 --concurrency 1,4 \\
        --uniform-batch 8 --uniform-prompt 128 --uniform-output 16   # a smoke run in seconds
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import report
from bench.common.paths import RESULTS
from bench.common.procs import Stopped, stop_on_signals
from bench.common.report import git_revision
from bench.generation import baselines, zserve_leg
from bench.generation import report as gen_report
from bench.generation.report import LEGS
from bench.generation.workload import GenRequest, GenRow, build_pool, closed_loop, schedule, summarize, uniform_batch
from bench.serving.targets import format_targets
from zserve.config import usable_cores

SERVE_STARTUP_S = 20.0  # what the estimate adds for the deployment's start (CPU, small model)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="a transformers folder, smollm2 or tiny (default %(default)s)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default %(default)s)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: float32 on cpu, else bfloat16)")
    p.add_argument("--concurrency", default="1,8,32", help="closed-loop concurrencies (default %(default)s)")
    p.add_argument(
        "--requests-per-caller",
        default="auto",
        help="N, or C:N,... per concurrency (default auto: 2 at c1, 1 above)",
    )
    p.add_argument(
        "--duration-s", type=float, default=None, help="instead: send for this long (what was started finishes)"
    )
    p.add_argument("--legs", default=",".join(LEGS), help="any of " + ",".join(LEGS) + " (default: all)")
    p.add_argument("--threads", type=int, default=2, help="torch threads here and in the engine (default %(default)s)")
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--static-batch", type=int, default=None, help="largest static group (default: the concurrency)")
    p.add_argument("--static-window-ms", type=float, default=50.0, help="grouping window after the first arrival")
    p.add_argument("--max-batched-tokens", type=int, default=256, help="the served engine's token budget per step")
    p.add_argument("--uniform-batch", type=int, default=32)
    p.add_argument("--uniform-prompt", type=int, default=512)
    p.add_argument("--uniform-output", type=int, default=64)
    p.add_argument("--uniform-batched-tokens", type=int, default=1024, help="the in-process engine's step budget")
    p.add_argument("--no-uniform", action="store_true", help="skip the uniform-batch line")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "issue4-generate.json")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    args.legs = [leg for leg in args.legs.split(",") if leg]
    if bad := sorted(set(args.legs) - set(LEGS)):
        p.error(f"unknown leg(s) {', '.join(bad)}; choose from {', '.join(LEGS)}")
    args.per_caller = per_caller(args.requests_per_caller, args.concurrency, p)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    return args


def per_caller(spec: str, concurrency: list[int], parser: argparse.ArgumentParser) -> dict[int, int]:
    if spec == "auto":
        # SmolLM2 on 2 cores: one request takes ~15 s alone, so single at c32 is ~8 min per request per caller
        return {c: 2 if c <= 1 else 1 for c in concurrency}
    if ":" not in spec:
        return dict.fromkeys(concurrency, int(spec))
    given = {int(c): int(n) for c, n in (part.split(":") for part in spec.split(","))}
    if missing := [c for c in concurrency if c not in given]:
        parser.error(f"--requests-per-caller says nothing for concurrency {missing}")
    return {c: given[c] for c in concurrency}


def estimate_s(leg: str, callers: list[list[GenRequest]], cal: dict[str, float], static_batch: int | None) -> float:
    """Rough seconds for one scenario of one leg, from the calibration (step time linear in the batch)."""
    b1, bmax, top = cal["step_s_b1"], cal["step_s_bmax"], cal["bmax"]

    def step(b: int) -> float:
        return b1 if top <= 1 else b1 + (bmax - b1) * (b - 1) / (top - 1)

    def prefill(tokens: int) -> float:
        return tokens / cal["prefill_tok_s"]

    requests = [r for mine in callers for r in mine]
    if leg == "single":
        return sum(prefill(len(r.prompt_ids)) + r.output_len * step(1) for r in requests)
    if leg == "static":
        size, total = static_batch or len(callers), 0.0
        for round_ in zip(*callers, strict=True):
            for g in (round_[i : i + size] for i in range(0, len(round_), size)):
                longest_prompt, steps = max(len(r.prompt_ids) for r in g), max(r.output_len for r in g)
                total += prefill(len(g) * longest_prompt) + steps * step(len(g))
        return total
    # continuous batching: the longest caller's chain of steps at batch c, every prompt prefilled once
    chain = max(sum(r.output_len for r in mine) for mine in callers)
    return chain * step(len(callers)) + prefill(sum(len(r.prompt_ids) for r in requests))


def prepare(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Model, workload, calibration and estimates; prints the header."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    path = zserve_leg.resolve_model(args.model, args.dtype, workdir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).to(args.device)
    context = getattr(model.config, "max_position_embeddings", None) or 1 << 30
    for what, need in (
        ("--max-prompt + --max-output", args.max_prompt + args.max_output),
        ("--uniform-prompt + --uniform-output", 0 if args.no_uniform else args.uniform_prompt + args.uniform_output),
    ):
        if need > context:
            raise SystemExit(f"generate: {what} = {need} tokens is over the model's context of {context}")
    gen = baselines.HFGenerator(model, tokenizer, args.device)
    size = 4 * max(args.concurrency) if args.duration_s else max(c * n for c, n in args.per_caller.items())
    pool = build_pool(
        tokenizer, size, args.seed, (args.min_prompt, args.max_prompt), (args.min_output, args.max_output)
    )
    scenarios = {c: schedule(pool, c, size // c if args.duration_s else args.per_caller[c]) for c in args.concurrency}
    batch = uniform_batch(tokenizer, args.uniform_batch, args.uniform_prompt, args.uniform_output, args.seed)
    cal = baselines.calibrate(gen, min(max(args.concurrency), 32))
    estimates = {
        leg: {
            c: args.duration_s * 1.1 if args.duration_s else estimate_s(leg, callers, cal, args.static_batch)
            for c, callers in scenarios.items()
        }
        for leg in args.legs
    }
    est_uniform = 0.0
    if not args.no_uniform:  # both sides: prefill the batch, then the decode steps at (about) this batch
        step_s = cal["step_s_bmax"] * args.uniform_batch / cal["bmax"]
        est_uniform = 2 * (
            args.uniform_batch * args.uniform_prompt / cal["prefill_tok_s"] + args.uniform_output * step_s
        )
    total = sum(sum(e.values()) for e in estimates.values()) + est_uniform
    total += SERVE_STARTUP_S if "zserve" in args.legs else 0.0
    when = f"for {args.duration_s:g} s" if args.duration_s else str(args.per_caller)
    print(f"zserve generate bench  git {git_revision()}  {args.device} {args.dtype}  torch threads {args.threads}  "
          f"model {path}")  # fmt: skip
    print(f"workload: prompts {args.min_prompt}-{args.max_prompt} tokens, outputs {args.min_output}-"
          f"{args.max_output} (seed {args.seed}); concurrency {args.concurrency}, requests per caller {when}; "
          f"legs {args.legs}")  # fmt: skip
    print(f"calibration (model.generate): prefill {cal['prefill_tok_s']:.0f} tok/s, decode step "
          f"{cal['step_s_b1'] * 1000:.1f} ms at batch 1, {cal['step_s_bmax'] * 1000:.1f} ms at batch {cal['bmax']}; "
          f"setup {time.perf_counter() - t0:.1f} s")  # fmt: skip
    parts = [f"{leg} {sum(e.values()):.0f} s" for leg, e in estimates.items()]
    parts += [f"uniform line {est_uniform:.0f} s"] if est_uniform else []
    print(f"expected run time: about {total / 60:.1f} min ({', '.join(parts)})", flush=True)
    return {"path": path, "context": context, "gen": gen, "pool": pool, "scenarios": scenarios, "batch": batch,
            "calibration": cal, "estimates": estimates, "estimated_total_s": total}  # fmt: skip


def run_leg(leg: str, args: argparse.Namespace, ctx: dict[str, Any], rows: list[GenRow]) -> None:
    """Every concurrency of one leg, a row each (appended as it is measured)."""
    gen: baselines.HFGenerator = ctx["gen"]
    served = None
    if leg == "zserve":
        tokens = args.max_prompt + args.max_output
        options = zserve_leg.engine_options(
            ctx["path"], args.dtype, max(args.concurrency), tokens, args.max_batched_tokens
        )
        served = zserve_leg.ServedLeg(options, args.threads, args.device)
        print(f"  zserve deployment ready in {served.startup_s:.1f} s; engine options {options}", flush=True)
    try:
        (served or gen).warm_up()
        for c, callers in ctx["scenarios"].items():
            detail: dict[str, Any] = {"estimated_s": ctx["estimates"][leg][c]}
            if leg == "zserve":
                call: Any = served
            elif leg == "static":
                call = baselines.StaticBatcher(gen, args.static_batch or c, args.static_window_ms / 1000)
            else:
                call = baselines.one_at_a_time(gen)
            try:
                timings, wall_s = closed_loop(call, callers, args.duration_s)
            finally:
                if leg != "zserve":
                    call.close()
            if leg == "static":
                detail |= {"groups": call.groups, "mean_group": sum(call.groups) / max(1, len(call.groups))}
            if served is not None and served.mismatches:
                detail["length_mismatches"] = served.mismatches[:20]
                served.mismatches.clear()
            row = summarize(leg, c, timings, wall_s, **detail)
            rows.append(row)
            print(f"  {leg:<6} c{c:<3} {row.requests:>4} requests {row.output_tokens:>6} tokens in {wall_s:7.1f} s: "
                  f"{row.tok_s:8.1f} tok/s  TTFT p50 {row.ttft_p50_ms:7.0f} ms  TPOT p50 {row.tpot_p50_ms:6.1f} ms  "
                  f"(estimated {detail['estimated_s']:.0f} s)", flush=True)  # fmt: skip
    finally:
        if served is not None:
            served.close()


def run_uniform(args: argparse.Namespace, ctx: dict[str, Any]) -> dict[str, Any]:
    """The engine core (``zserve.pipeline``) and ``model.generate`` on the same uniform batch."""
    result: dict[str, Any] = {"batch": args.uniform_batch, "prompt": args.uniform_prompt, "output": args.uniform_output}
    tokens = args.uniform_prompt + args.uniform_output
    pipe = zserve_leg.engine_pipeline(
        ctx["path"], args.device, args.dtype, args.uniform_batch, tokens, args.uniform_batched_tokens
    )
    result["zserve_core"] = zserve_leg.engine_uniform(pipe, ctx["batch"])
    del pipe  # its KV pool
    result["hf_generate"] = baselines.hf_uniform(ctx["gen"], ctx["batch"])
    result["ratio"] = result["zserve_core"]["tok_s"] / result["hf_generate"]["tok_s"]
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_signals()
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    meta: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git": git_revision(), "cpu_cores": usable_cores(),
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }  # fmt: skip
    rows: list[GenRow] = []
    failures: dict[str, str] = {}
    uniform: dict[str, Any] | None = None
    shape = f"{args.uniform_batch} x {args.uniform_prompt} tokens -> {args.uniform_output}"
    interrupted = False
    with tempfile.TemporaryDirectory(prefix="zserve-genbench-") as tmp:
        try:
            ctx = prepare(args, Path(tmp))
            meta |= {k: ctx[k] for k in ("path", "context", "calibration", "estimates", "estimated_total_s")}
            meta["workload"] = [[len(r.prompt_ids), r.output_len] for r in ctx["pool"]]  # [prompt, output] tokens
            for leg in args.legs:
                try:
                    run_leg(leg, args, ctx, rows)
                except (zserve_leg.LegUnavailable, RuntimeError, ValueError, OSError, TypeError) as exc:
                    failures[leg] = f"{type(exc).__name__}: {exc}"
                    print(f"  {leg}: FAILED: {failures[leg]}", file=sys.stderr, flush=True)
            if not args.no_uniform:
                try:
                    uniform = run_uniform(args, ctx)
                except (RuntimeError, ValueError, OSError, ImportError, TypeError) as exc:
                    failures["uniform"] = f"{type(exc).__name__}: {exc}"
                    print(f"  uniform: FAILED: {failures['uniform']}", file=sys.stderr, flush=True)
        except (KeyboardInterrupt, Stopped) as exc:
            interrupted = True
            why = f"stopped by {exc}" if isinstance(exc, Stopped) else "interrupted"
            print(f"\ngenerate: {why}; reporting what was measured", file=sys.stderr)
    gen_report.add_ratios(rows)
    checked = gen_report.evaluate(rows, uniform, shape)
    document = {"meta": meta | {"interrupted": interrupted}, "results": [r.to_json() for r in rows],
                "uniform": uniform, "targets": [t.to_json() for t in checked], "failures": failures}  # fmt: skip
    report.write_json(args.out, document)  # files first: a closed stdout must not lose the results
    plot = args.out.with_suffix(".png")
    plotted = bool(rows) and gen_report.write_plot(plot, rows)
    print()
    print(gen_report.format_table(rows))
    print("TTFT: sent to first token; TPOT: (last - first token) / (tokens - 1); x static: tok/s over static's.")
    if uniform:
        print(f"uniform batch {shape}: zserve engine core {uniform['zserve_core']['tok_s']:.1f} tok/s, "
              f"model.generate {uniform['hf_generate']['tok_s']:.1f} tok/s: {uniform['ratio']:.2f}x")  # fmt: skip
    print()
    print(format_targets(checked))
    for leg, why in failures.items():
        print(f"WARNING {leg} did not run: {why}")
    print(f"\nwrote {args.out}" + (f" and {plot}" if plotted else ""))
    return 130 if interrupted else 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())

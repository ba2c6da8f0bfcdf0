#!/usr/bin/env python
"""Does ``cpu_linear = "auto"`` choose as well as the best fixed tile for whole decode steps? Engines of the same
model, each with its linear products pinned to one of our kernel's schedules for this ISA
(``native_linear.variants``), oneDNN, or chosen by ``kernel_tune`` (``auto``), stepped in turns at a few batch
sizes; the step's median time per engine, one torch thread (the thread's CPU time). ``auto-l3`` is the tuner's
choice made as before issue 33's fix (16 MiB of weights, within an L3 of 32 MiB; 32 rows on a hot slice), for
comparison. Both tuners measure every candidate here however long it takes (on a machine far busier than its
cores, the engine's tuner stops after ~2 s and leaves the rest on oneDNN).

    .venv/bin/python -m bench.studies.tile_check --batch 1,8,32                    # this CPU's ISA
    .venv/bin/python -m bench.studies.tile_check --batch 1,8,32 --isa avx2,avx512
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch

from bench.common import report
from bench.common.paths import RESULTS
from bench.generation import zserve_leg
from bench.studies import isa as study_isa
from zserve.generator import kernel_choice, kernel_tune, native_linear
from zserve.generator.generator import Generator, GeneratorOptions
from zserve.generator.sequence import SamplingParams


@contextlib.contextmanager
def _pinned(config: str, cache: Path) -> Iterator[None]:
    """While an engine loads: ``auto`` as it is, ``auto-l3`` measured the old way, or one candidate only (the tuner
    then times it alone and takes it everywhere), each with a cache of its own (a choice's key names no candidates).
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict("os.environ", {"ZSERVE_CACHE_DIR": str(cache / config)}))
        # on a machine busier than its cores the tuner stops at ~2 s, the rest on oneDNN: not here
        stack.enter_context(mock.patch.object(kernel_tune, "_GRACE_S", 600.0))
        if config == "auto-l3":
            stack.enter_context(mock.patch.object(kernel_tune, "last_level_cache_bytes", lambda: int((16 << 20) / 1.5)))
            stack.enter_context(mock.patch.object(kernel_tune, "_FEW_ROWS", 16))
            stack.enter_context(mock.patch.object(kernel_tune._Flush, "__call__", lambda self: None))
        elif config != "auto":
            stack.enter_context(mock.patch.object(kernel_tune, "candidates", lambda weight: [config]))
        yield


def configs() -> list[str]:
    isa = native_linear.variants()[0].isa
    return [
        "auto",
        "auto-l3",
        kernel_choice.ONEDNN,
        *(kernel_choice.native(isa, v.name) for v in native_linear.variants()),
    ]


def measure(path: str, names: list[str], batches: list[int], prompt: int, steps: int) -> list[dict]:
    options = GeneratorOptions(num_blocks=640, block_size=16, max_batched_tokens=512, max_running=32, cpu_linear="auto")
    engines = {}
    with tempfile.TemporaryDirectory() as cache:
        for name in names:
            with _pinned(name, Path(cache)):
                engines[name] = Generator.load(path, dtype="float32", options=options)
    rows = []
    for b in batches:
        samples: dict[str, list[float]] = {name: [] for name in names}
        for engine in engines.values():
            core = engine.core
            for i in range(b):
                core.add(i, [(7 * i + j) % 1000 + 10 for j in range(prompt)],
                         SamplingParams(max_new_tokens=steps + 4, ignore_eos=True))  # fmt: skip
            while core.stats.batch_tokens != b or any(s.num_computed < prompt for s in core.sequences.values()):
                core.step()
        for _ in range(steps):
            for name, engine in engines.items():  # in turns: the machine's other load falls on all alike
                t0 = time.thread_time()
                engine.core.step()
                samples[name].append(time.thread_time() - t0)
        for name, engine in engines.items():
            for i in range(b):
                engine.core.abort(i)
            rows.append({"config": name, "batch": b, "step_ms": statistics.median(samples[name]) * 1e3,
                         "best_ms": min(samples[name]) * 1e3})  # fmt: skip
    for engine in engines.values():
        engine.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="a transformers folder, smollm2 or tiny (default %(default)s)")
    p.add_argument("--configs", default="", help="a comma list of auto, auto-l3, onednn, native:ISA/VARIANT (all)")
    p.add_argument("--batch", default="1,8,32", help="decode batch sizes (default %(default)s)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence (default %(default)s)")
    p.add_argument("--steps", type=int, default=15, help="decode steps timed per batch (default %(default)s)")
    p.add_argument("--out", default=str(RESULTS / "tile_check.json"))
    study_isa.add_argument(p)
    args = p.parse_args(argv)
    if study_isa.delegate("bench.studies.tile_check", argv, study_isa.parse(args.isa), Path(args.out)) is not None:
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("zserve.engine").setLevel(logging.INFO)  # each tuner's choice, in one line
    torch.set_num_threads(1)
    names = args.configs.split(",") if args.configs else configs()
    print(f"{study_isa.cpu()}\n{study_isa.describe()}; 1 thread; configs {', '.join(names)}", flush=True)
    batches = [int(b) for b in args.batch.split(",")]
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        path = zserve_leg.resolve_model(args.model, "float32", Path(tmp))
        rows = measure(path, names, batches, args.prompt, args.steps)
    print(f"{'config':<22}{'batch':>6}{'median ms':>11}{'best ms':>9}{'x best fixed':>14}")
    for b in batches:
        mine = [r for r in rows if r["batch"] == b]
        fixed = min((r["step_ms"] for r in mine if not r["config"].startswith("auto")), default=float("nan"))
        for r in mine:
            print(f"{r['config']:<22}{b:>6}{r['step_ms']:>11.2f}{r['best_ms']:>9.2f}{fixed / r['step_ms']:>13.3f}x")
    print(f"(medians of {args.steps} decode steps after prompts of {args.prompt} tokens, thread CPU time; "
          "x best fixed: the fastest pinned config's median over this one's)")  # fmt: skip
    report.write_json(Path(args.out), {"args": vars(args), "cpu": study_isa.cpu(), "isa": study_isa.describe(),
                                       "rows": rows})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

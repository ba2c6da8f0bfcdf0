"""The generative engine's scheduler with priorities (issue 37): its cost per step against another scheduler
module (the FIFO one before issue 37: ``git show fbb89cc:zserve/generator/scheduler.py > /tmp/old.py``), both
in this process, N decoding sequences without a model (``schedule()`` timed alone, a fake step appending a
token to each between calls), best of several runs. Prints a table and writes JSON to bench/results.

    .venv/bin/python -m bench.studies.engine_priority --old /tmp/old.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import time
from types import ModuleType

from bench.common.paths import RESULTS
from zserve.generator import step_scheduler as ranked
from zserve.generator.block_manager import BlockManager
from zserve.generator.sequence import SamplingParams, Sequence


def load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("old_step_scheduler", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def scheduler(module: ModuleType, n: int, priorities: bool):
    s = module.StepScheduler(BlockManager(4096, 16), max_batched_tokens=512, max_running=n, chunked_prefill=True)
    rng = random.Random(0)
    for i in range(n):
        priority = rng.randrange(-3, 4) if priorities else 0
        seq = Sequence(
            i, [rng.randrange(1000) for _ in range(37)], SamplingParams(max_new_tokens=10**6), priority=priority
        )
        if module is ranked:
            s.add(seq, 0.001 * i)
        else:
            s.add(seq)
    return s


def per_step_s(s, steps: int = 200) -> float:
    """Mean time of ``schedule()`` alone (the fake step's block appends are not timed)."""
    timed = 0.0
    for _ in range(steps):
        started = time.perf_counter()
        chunks = s.schedule()
        timed += time.perf_counter() - started
        for c in chunks:
            c.seq.num_computed = c.end
            if c.samples:
                s.blocks.append(c.seq.kv, 5)
    return timed / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--old", required=True, help="the scheduler module to compare with")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    old = load(args.old)
    rows = []
    print("| running | scheduler | us per step | ratio |\n| --- | --- | --- | --- |")
    for n in (8, 64):
        base = None
        for name, module, priorities in (("old", old, False), ("ranked, all 0", ranked, False),
                                         ("ranked, -3..3", ranked, True)):  # fmt: skip
            best = min(per_step_s(scheduler(module, n, priorities)) for _ in range(args.repeats))
            base = base or best
            rows.append({"running": n, "scheduler": name, "us_per_step": best * 1e6, "ratio": best / base})
            print(f"| {n} | {name} | {best * 1e6:.1f} | {best / base:.2f} |")
    out = RESULTS / f"engine-priority-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

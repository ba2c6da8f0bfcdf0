#!/usr/bin/env python
"""What cache-aware routing costs the broker: its pure core (``BrokerCore``, no sockets) with ``--engines``
simulated generative engines, each registered with a Hello snapshot of ``--blocks`` block hashes, fed
``--requests`` sequences of ``--prompt-blocks`` hashes (each sharing a random engine's leading blocks), and
finishing each at once. Per request: admit (Submits), route and dispatch (tick), flush, the engine's final
StepOutput with its cache deltas (its prompt's last 4 blocks stored; each engine is full, so it reports its 4
least recently used evicted, as an engine's block manager does: never its shared prefix, which the requests
that match it keep recent). The hashes reach the core as fresh ints decoded from msgpack just before, as the
broker's shell hands them over. Reported: broker CPU per request (thread time of the core's calls alone,
median) with ``routing = "cache_aware"`` on the C index (``zserve.batching.prefix_table``, what the broker runs
where it can build it), on the dict index (``prefix_index.PrefixIndex``, where it cannot), and with
``"least_loaded"`` (best of ``--repeat``, the three interleaved in this one process), the differences, split
into their two phases (admitting, routing and dispatching a request; the engine's step message with its
deltas), and each index's size in entries and bytes (tracemalloc, which counts the C index's memory too).

    .venv/bin/python -m bench.generation routing-cost                     # 64 engines
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import tracemalloc
from collections import deque

import msgspec

from zserve.batching.prefix_index import MIN_ENTRIES, PrefixIndex
from zserve.batching.prefix_table import native_index
from zserve.batching.routing import PrefixRouter
from zserve.broker.core import BrokerCore
from zserve.config import parse_config
from zserve.protocol import Hello, Status, StepOutput, Submit, Submits

CONFIG = """
[[models]]
name = "lm"
handler = "x:Y"
engines = {engines}
routing = "{routing}"
max_queue = 100000
"""


VARIANTS = {"least_loaded": "least_loaded", "cache_aware": "cache_aware", "cache_aware, dict index": "cache_aware"}


def build(
    variant: str, args: argparse.Namespace, rng: random.Random
) -> tuple[BrokerCore, list[list[int]], dict[str, tuple[deque[int], set[int]]]]:
    """The core with its engines registered, each engine's leading blocks, and what each engine holds."""
    core = BrokerCore(parse_config(CONFIG.format(engines=args.engines, routing=VARIANTS[variant])), epoch=1,
                      generative=frozenset({"lm"}))  # fmt: skip
    if variant == "cache_aware, dict index":  # as a broker routes where it cannot build the C index
        core.routes.routers["lm"] = PrefixRouter(native=False)
    prefixes, cached = [], {}
    for e in range(args.engines):
        held = [rng.getrandbits(64) for _ in range(args.blocks)]
        prefixes.append(held[: args.prompt_blocks])
        name = f"engine-{e}:1"
        # eviction order: its prefix blocks never go (the requests that match them keep them recent in its LRU)
        cached[name] = (deque(held[args.prompt_blocks :]), set(held))
        core.on_work(name.encode(), Hello(name, 1, "engine", ["lm"], 64, kv_blocks=args.blocks, block_hashes=held), 0.0)
    core.flush()
    return core, prefixes, cached


def run(variant: str, args: argparse.Namespace) -> tuple[tuple[float, float, float], int]:
    """Seconds of broker CPU per request (the median: robust to the preemptions of a shared machine) in all, for
    the request (admit, route, dispatch) and for the engine's step (its deltas), and the index's entries."""
    rng = random.Random(args.seed)
    core, prefixes, held = build(variant, args, rng)
    prompts = []
    for _ in range(args.requests):
        shared = rng.randrange(args.prompt_blocks + 1)
        own = [rng.getrandbits(64) for _ in range(args.prompt_blocks - shared)]
        prompts.append(msgspec.msgpack.encode(rng.choice(prefixes)[:shared] + own))
    # what the run set up (the index, the engines) is old by the time a broker serves: kept out of the young
    # generations, so collections cost what a long-running broker's cost, not a scan of the fresh set-up
    gc.collect()
    gc.freeze()
    clock = time.thread_time  # CPU time: what the broker spends, not the waits for a core on a shared machine
    spent, routing_s, stepping_s = [], [], []
    for i, encoded in enumerate(prompts):
        # decoded as the broker's shell does, just before the core sees them: what its probes read is in cache
        hashes = msgspec.msgpack.decode(encoded)
        now = i * 1e-4
        submits = Submits([Submit(i, "lm", block_hashes=hashes)], [1])
        started = clock()
        core.on_client(b"c", submits, [b"{}"], now)
        core.tick(now)
        _, work = core.flush()
        routed = clock() - started
        steps = []
        for send in work:  # the sequence finishes in one step; its engine stored its prompt's blocks
            header = send.header
            if hasattr(header, "item_ids"):
                engine = send.worker_id.decode()
                order, members = held[engine]
                stored = [h for h in hashes[-4:] if h not in members]  # what a real engine's cache reports
                order.extend(stored)
                evicted = [order.popleft() for _ in stored]
                members.update(stored)
                members.difference_update(evicted)
                steps.append(StepOutput(engine, [header.batch_id], [""], [1], [True], [Status.OK], [""], [1],
                             stored_blocks=_decoded(stored), evicted_blocks=_decoded(evicted)))  # fmt: skip
        started = clock()
        for done in steps:
            core.on_out(done, [b"{}"], now)
        core.flush()
        stepped = clock() - started
        spent.append(routed + stepped)
        routing_s.append(routed)
        stepping_s.append(stepped)
    gc.unfreeze()
    medians = statistics.median(spent), statistics.median(routing_s), statistics.median(stepping_s)
    router = core.routes.routers.get("lm")
    return medians, len(router.index) if router else 0


def _decoded(hashes: list[int]) -> list[int]:
    """The hashes as the broker's shell hands them over: fresh ints decoded from a message, not the objects the
    index holds as keys (where a lookup compares identity first, and would skip reading the key it finds)."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(hashes))


def index_bytes(args: argparse.Namespace, new_index: type[PrefixIndex]) -> tuple[int, int, int]:
    """The index's own memory (tracemalloc, everything it keeps: the hash ints if it keeps any, its table or
    dict, the engines' logs) for ``--engines`` x ``--blocks`` entries, from the Hellos' snapshots (decoded lists,
    dropped after), then at its worst: each engine's log at the edge of its compaction (twice its bound: stored
    and evicted, as an engine's churn leaves it; the eviction order is the index's own export, taken after the
    first figure, so none of this function's bookkeeping is in either). Returns (entries, bytes after the
    snapshots, bytes at the worst)."""
    rng = random.Random(args.seed)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = new_index()
    engines = [f"engine-{e}".encode() for e in range(args.engines)]
    for engine in engines:
        hashes = _decoded([rng.getrandbits(64) for _ in range(args.blocks)])
        index.reset(engine, hashes, kv_blocks=args.blocks)
        del hashes
    snapshot = tracemalloc.get_traced_memory()[0] - before
    held = {slot[0]: deque(slot[2]) for slot in index.export() if slot is not None}  # oldest first
    limit = max(args.blocks, MIN_ENTRIES)
    for engine in engines:  # churn until the log is one delta short of its compaction
        order = held.pop(engine)
        for _ in range((2 * limit - args.blocks) // 4):
            stored = _decoded([rng.getrandbits(64) for _ in range(4)])
            evicted = [order.popleft() for _ in range(4)]
            order.extend(stored)
            index.update(engine, stored, evicted)
            del stored, evicted
        del order
    worst = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return len(index), snapshot, worst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=64)
    p.add_argument("--blocks", type=int, default=2048, help="block hashes each engine holds (default %(default)s)")
    p.add_argument("--prompt-blocks", type=int, default=64, help="prompt blocks per request (default %(default)s)")
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    variants = list(VARIANTS) if native_index() is not None else ["least_loaded", "cache_aware, dict index"]
    best: dict[str, list[float]] = {}
    entries = 0
    for _ in range(args.repeat):
        for variant in variants:
            medians, n = run(variant, args)
            best[variant] = [min(a, b) for a, b in zip(best.get(variant, medians), medians, strict=True)]
            entries = n or entries
    plain = best["least_loaded"]
    print(f"{args.engines} engines x {args.blocks} blocks held, {args.prompt_blocks} prompt blocks per request, "
          f"best of {args.repeat} x {args.requests} requests; broker CPU per request (median):")  # fmt: skip
    print(f"  least_loaded {plain[0] * 1e6:.1f} us (the request {plain[1] * 1e6:.1f}, the step {plain[2] * 1e6:.1f})")
    for variant in variants[1:]:
        routed = best[variant]
        adds = [(r - p) * 1e6 for r, p in zip(routed, plain, strict=True)]
        print(f"  {variant} {routed[0] * 1e6:.1f} us: +{adds[0]:.1f} us for routing (the request +{adds[1]:.1f} us, "
              f"{plain[1] * 1e6:.1f} -> {routed[1] * 1e6:.1f}; the step's deltas +{adds[2]:.1f} us, "
              f"{plain[2] * 1e6:.1f} -> {routed[2] * 1e6:.1f})")  # fmt: skip
    indexes = {"C": native_index(), "dict": PrefixIndex}
    for name, new_index in indexes.items():
        if new_index is None:
            continue
        entries, snapshot, worst = index_bytes(args, new_index)
        print(f"{name} index: {entries} entries (the bound: each engine's KV blocks, {MIN_ENTRIES} at least), "
              f"{snapshot / 2**20:.1f} MiB from the Hellos ({snapshot / entries:.0f} bytes an entry), "
              f"{worst / 2**20:.1f} MiB at its worst ({worst / entries:.0f} bytes an entry: "
              f"each log at twice its bound, just before compaction)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

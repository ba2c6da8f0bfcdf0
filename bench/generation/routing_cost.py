#!/usr/bin/env python
"""What cache-aware routing costs the broker: its pure core (``BrokerCore``, no sockets) with ``--engines``
simulated generative engines, each registered with a Hello snapshot of ``--blocks`` block hashes, fed
``--requests`` sequences of ``--prompt-blocks`` hashes (each sharing a random engine's leading blocks), and
finishing each at once. Per request: admit (Submits), route and dispatch (tick), flush, the engine's final
StepOutput with its cache deltas (its prompt's last 4 blocks stored; each engine is full, so it reports its 4
least recently used evicted, as an engine's block manager does: never its shared prefix, which the requests
that match it keep recent). Each request's Submits header is decoded in the timed part, as the broker's shell
decodes it (``protocol.Codec``): its hashes packed as frontends send them (``Submit.block_hashes_packed``; with
``--wire list``, a list of ints as older frontends did), none for least_loaded (whose frontends send none), so
what the hashes cost to decode counts as routing's. ``--in-flight K`` keeps K sequences in flight (each
finishes once K later ones were routed, first in, first out), so requests meet prompts in flight under their
first block, as under load; with ``--blocks 1024`` (the bound's floor) and the default 20,000 requests every
engine's log reaches its compaction (reported).

Reported: broker CPU per request (thread time of the core's calls alone, median and mean: the mean counts the
compactions the median hides) with ``routing = "cache_aware"`` on the C index (``zserve.batching.prefix_table``,
what the broker runs where it can build it), on the dict index (``prefix_index.PrefixIndex``, where it cannot),
and with ``"least_loaded"`` (best of ``--repeat``, the three interleaved in this one process), the differences,
split into their two phases (admitting, routing and dispatching a request; the engine's step message with its
deltas), and each index's size in entries and bytes (tracemalloc, which counts the C index's memory too).

    .venv/bin/python -m bench.generation routing-cost                     # 64 engines
    .venv/bin/python -m bench.generation routing-cost --in-flight 64 --blocks 1024   # under load, compacting
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import tracemalloc
from collections import deque
from collections.abc import Callable

import msgspec

from zserve.batching.prefix_hash import pack
from zserve.batching.prefix_index import MIN_ENTRIES, PrefixIndex
from zserve.batching.prefix_table import native_index
from zserve.batching.routing import PrefixRouter
from zserve.broker.core import BrokerCore
from zserve.config import parse_config
from zserve.protocol import Codec, Hello, Status, StepOutput, Submit, Submits

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


def _timed(fn: Callable[..., object], spent_ns: list[int]) -> Callable[..., object]:
    """``fn``, adding the nanoseconds each call takes to ``spent_ns[0]`` and counting calls in ``spent_ns[1]``."""

    def timed(*a: object) -> object:
        started = time.perf_counter_ns()
        try:
            return fn(*a)
        finally:
            spent_ns[0] += time.perf_counter_ns() - started
            spent_ns[1] += 1

    return timed


def _timer_ns() -> float:
    """What ``_timed`` counts for a call of nothing (its clock and the extra call): taken off each timed call."""
    spent = [0, 0]
    nothing = _timed(lambda *a: None, spent)
    best = float("inf")
    for _ in range(5):
        spent[0] = 0
        for _ in range(20000):
            nothing(None, None)
        best = min(best, spent[0] / 20000)
    return best


def run(
    variant: str, args: argparse.Namespace, own: list[float] | None = None
) -> tuple[list[float], int, list[tuple[str, int]]]:
    """Seconds of broker CPU per request, in all, for the request (admit, route, dispatch) and for the engine's
    step (its deltas), each as (median, mean): the median is robust to the preemptions of a shared machine, the
    mean counts the rare costly request (an engine's log compaction) the median hides; the index's entries; and
    the engines whose logs were compacted, with how often. ``own``: given, the router's own seconds per request
    are appended to it (its calls timed one by one: its choice, its deltas, its in-flight prompts' removal), what
    routing adds whatever the pool's own choice costs (which the load the routing leaves changes).
    With ``--in-flight K`` each sequence finishes only once K later ones are in flight (first in, first out):
    a request then meets prompts in flight under its first block, as under load."""
    rng = random.Random(args.seed)
    core, prefixes, held = build(variant, args, rng)
    prompts, codec = [], Codec()
    for i in range(args.requests):
        shared = rng.randrange(args.prompt_blocks + 1)
        hashes = rng.choice(prefixes)[:shared] + [rng.getrandbits(64) for _ in range(args.prompt_blocks - shared)]
        if variant == "least_loaded":
            blocks = {}
        else:
            blocks = {"block_hashes": hashes} if args.wire == "list" else {"block_hashes_packed": pack(hashes)}
        prompts.append((codec.encode(Submits([Submit(i, "lm", **blocks)], [1])), hashes))
    # what the run set up (the index, the engines) is old by the time a broker serves: kept out of the young
    # generations, so collections cost what a long-running broker's cost, not a scan of the fresh set-up
    gc.collect()
    gc.freeze()
    clock = time.thread_time  # CPU time: what the broker spends, not the waits for a core on a shared machine
    spent, routing_s, stepping_s = [], [], []
    flying: deque[tuple[str, int, list[int]]] = deque()  # (engine, batch, its prompt's hashes), oldest first
    router = core.routes.routers.get("lm")
    compacted: dict[str, int] = {}  # engine -> its log's compactions in this run
    own_ns = [0, 0]  # (ns, calls) since the request began
    timer_ns = _timer_ns() if own is not None else 0.0
    if own is not None and router is not None:
        core.scheduler.routes["lm"] = _timed(core.routes.choose, own_ns)  # type: ignore[assignment]
        core.routes.on_step = _timed(core.routes.on_step, own_ns)  # type: ignore[method-assign]
        core.pool.on_finished = _timed(core.routes.finished, own_ns)  # type: ignore[assignment]
    for i, (encoded, hashes) in enumerate(prompts):
        now = i * 1e-4
        started = clock()
        submits = codec.decode(encoded)  # as the broker's shell does
        core.on_client(b"c", submits, [b"{}"], now)
        core.tick(now)
        _, work = core.flush()
        routed = clock() - started
        for send in work:
            if hasattr(send.header, "item_ids"):
                flying.append((send.worker_id.decode(), send.header.batch_id, hashes))
        steps = []
        while len(flying) > args.in_flight:  # the oldest finish; their engines stored their prompts' blocks
            engine, batch_id, prompt = flying.popleft()
            order, members = held[engine]
            stored = [h for h in prompt[-4:] if h not in members]  # what a real engine's cache reports
            order.extend(stored)
            evicted = [order.popleft() for _ in stored]
            members.update(stored)
            members.difference_update(evicted)
            steps.append(StepOutput(engine, [batch_id], [""], [1], [True], [Status.OK], [""], [1],
                         stored_blocks=_decoded(stored), evicted_blocks=_decoded(evicted)))  # fmt: skip
        logs = [router.index.log_size(d.worker.encode()) for d in steps] if router else []
        started = clock()
        for done in steps:
            core.on_out(done, [b"{}"], now)
        core.flush()
        stepped = clock() - started
        for done, before in zip(steps, logs, strict=False):  # the log shrank: compacted (or trimmed) in this step
            if router is not None and router.index.log_size(done.worker.encode()) < before:
                compacted[done.worker] = compacted.get(done.worker, 0) + 1
        spent.append(routed + stepped)
        if own is not None:
            own.append((own_ns[0] - own_ns[1] * timer_ns) * 1e-9)
            own_ns[0] = own_ns[1] = 0
        routing_s.append(routed)
        stepping_s.append(stepped)
    gc.unfreeze()
    figures = [f(xs) for xs in (spent, routing_s, stepping_s) for f in (statistics.median, statistics.fmean)]
    return figures, len(router.index) if router else 0, sorted(compacted.items())


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
    p.add_argument(
        "--wire",
        choices=["packed", "list"],
        default="packed",
        help="how the Submits carry the hashes: packed (frontends) or a list of ints (older ones)",
    )
    p.add_argument("--in-flight", type=int, default=0,
                   help="sequences kept in flight, finished first in, first out (default %(default)s)")  # fmt: skip
    args = p.parse_args(argv)
    variants = list(VARIANTS) if native_index() is not None else ["least_loaded", "cache_aware, dict index"]
    best: dict[str, list[float]] = {}
    compacted: dict[str, list[tuple[str, int]]] = {}
    for _ in range(args.repeat):
        for variant in variants:
            figures, _, compacted[variant] = run(variant, args)
            best[variant] = [min(a, b) for a, b in zip(best.get(variant, figures), figures, strict=True)]
    plain = best["least_loaded"]
    print(f"{args.engines} engines x {args.blocks} blocks held, {args.prompt_blocks} prompt blocks per request, "
          f"{args.in_flight} sequences in flight, best of {args.repeat} x {args.requests} requests; broker CPU per "
          f"request, median / mean:")  # fmt: skip

    def us(figures: list[float], at: int) -> str:
        return f"{figures[at] * 1e6:.1f} / {figures[at + 1] * 1e6:.1f}"

    print(f"  least_loaded {us(plain, 0)} us (the request {us(plain, 2)}, the step {us(plain, 4)})")
    for variant in variants[1:]:
        routed = best[variant]
        adds = [(r - p) * 1e6 for r, p in zip(routed, plain, strict=True)]
        print(f"  {variant} {us(routed, 0)} us: +{adds[0]:.1f} / +{adds[1]:.1f} us for routing (the request "
              f"+{adds[2]:.1f} / +{adds[3]:.1f}; the step's deltas +{adds[4]:.1f} / +{adds[5]:.1f})")  # fmt: skip
        own: list[float] = []
        run(variant, args, own)
        print(f"    the router's own calls (one more run, timed one by one, less the timer): "
              f"{statistics.median(own) * 1e6:.1f} / {statistics.fmean(own) * 1e6:.1f} us a request")  # fmt: skip
        counts = [n for _, n in compacted[variant]]
        print(f"    logs compacted in the last run: {len(counts)} of {args.engines} engines"
              + (f", {min(counts)}-{max(counts)} times each" if counts else ""))  # fmt: skip
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

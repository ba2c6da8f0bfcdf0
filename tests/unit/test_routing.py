"""Cache-aware routing: the pure policy and index (zserve.batching.routing), then the broker core routing
generative sequences by the Hellos' snapshots and the StepOutputs' deltas, under a fake clock."""

from __future__ import annotations

import random

import pytest

from zserve.batching.prefix_hash import pack
from zserve.batching.prefix_index import MIN_ENTRIES, PrefixIndex
from zserve.batching.prefix_table import buildable, native_index
from zserve.batching.routing import LEAST_LOADED, MATCH, SPILL, Candidate, InFlightPrompts, PrefixRouter
from zserve.batching.workers import InFlightBatch, Worker
from zserve.broker.core import BrokerCore
from zserve.config import parse_config
from zserve.protocol import Batch, HealthQuery, Hello, StepOutput, Submit, Submits

A, B, C = b"a", b"b", b"c"


@pytest.fixture(params=[False, True], ids=["dict", "c"])
def native(request) -> bool:
    """Each test runs on the dict index and on the C one (``prefix_table``), where this machine can build it (and
    fails where it could be built but was not)."""
    if request.param and native_index() is None and not buildable():
        pytest.skip("no C compiler or Python headers here")
    return request.param


def new_index(native: bool) -> PrefixIndex:
    return native_index()() if native else PrefixIndex()  # type: ignore[misc]


def test_matches_count_leading_blocks_only(native):
    index = new_index(native)
    index.reset(A, [1, 2, 3, 4, 5, 6, 7])  # hashes of a chain: an engine holds a prefix of it
    index.reset(B, [1])
    index.reset(C, [9])
    assert index.matches([1, 2, 3, 4, 5, 6, 7, 8], [A, B, C]) == {A: 7, B: 1, C: 0}
    assert index.matches([1, 2, 3], [A, B]) == {A: 3, B: 1}
    for n in range(1, 8):  # the binary search finds every length
        index.reset(A, range(1, n + 1))
        assert index.matches(list(range(1, 12)), [A]) == {A: n}
    assert index.matches([], [A]) == {A: 0}


def test_deltas_store_and_evict_and_an_unknown_engine_is_ignored(native):
    index = new_index(native)
    index.reset(A, [])
    index.update(A, [1, 2], [])
    index.update(A, [3], [])
    assert index.matches([1, 2, 3], [A]) == {A: 3}
    index.update(A, [], [3, 2])  # a chain is evicted from its end
    assert index.matches([1, 2, 3], [A]) == {A: 1}
    index.update(C, [1, 2, 3], [])  # never said Hello: nothing is known of it
    assert index.matches([1], [C]) == {C: 0} and len(index) == 1


def test_the_index_is_bounded_per_engine_and_a_dead_engines_entries_go_at_once(native):
    index = new_index(native)
    index.reset(A, [], kv_blocks=10)  # its pool holds at most MIN_ENTRIES here (10 < MIN_ENTRIES)
    index.update(A, range(MIN_ENTRIES + 50), [])  # more than it can hold: deltas were lost, the oldest go
    assert len(index) == MIN_ENTRIES
    assert not index.holds(A, 0) and index.holds(A, MIN_ENTRIES + 49)
    index.reset(B, [7, 8])
    index.drop(A)
    assert len(index) == 2 and index.matches([7, 8], [A, B]) == {A: 0, B: 2}
    assert index.holders(7) == [B] and index.holders(0) == []  # nothing left pointing at the dead engine
    index.reset(B, [9])  # a restarted engine: its snapshot replaces what was known
    assert index.matches([7], [B]) == {B: 0} and index.matches([9], [B]) == {B: 1}


def test_an_engines_log_stays_within_twice_its_bound_under_churn(native):
    index = new_index(native)
    index.reset(A, [], kv_blocks=MIN_ENTRIES)
    for start in range(0, 20 * MIN_ENTRIES, 8):  # stored and evicted, as a full engine reports them
        index.update(A, range(start, start + 8), range(start - MIN_ENTRIES, start - MIN_ENTRIES + 8))
        assert index.log_size(A) <= 2 * MIN_ENTRIES
    assert len(index) == MIN_ENTRIES
    index.update(A, [], [20 * MIN_ENTRIES - 1])
    index.update(A, [20 * MIN_ENTRIES - 1], [])  # evicted, then stored again: held once, counted once
    assert len(index) == MIN_ENTRIES and index.holds(A, 20 * MIN_ENTRIES - 1)
    index.drop(A)  # the log finds every hash it still holds
    assert len(index) == 0 and not any(index.mask(h) for h in range(20 * MIN_ENTRIES))


def test_policy_match_spill_and_least_loaded(native):
    router = PrefixRouter(spill_ratio=1.5, spill_slack=2, native=native)
    router.index.reset(A, [1, 2, 3])
    router.index.reset(B, [1])
    # candidates come least loaded first
    d = router.choose([1, 2, 3, 4], [Candidate(B, 1), Candidate(A, 3)])
    assert (d.engine, d.reason, d.matched) == (A, MATCH, 3)
    # A runs 6 > 1.5 x 2 + 2: the request goes to the least loaded, which caches the prefix too
    d = router.choose([1, 2, 3, 4], [Candidate(B, 2), Candidate(A, 6)])
    assert (d.engine, d.reason, d.matched) == (B, SPILL, 1)
    d = router.choose([1, 2, 3, 4], [Candidate(B, 2), Candidate(A, 5)])  # 5 is within the bound
    assert d.engine == A and d.reason == MATCH
    d = router.choose([9, 9], [Candidate(B, 0), Candidate(A, 0)])  # held nowhere
    assert (d.engine, d.reason) == (B, LEAST_LOADED)
    d = router.choose([], [Candidate(A, 4), Candidate(B, 5)])  # no blocks given
    assert (d.engine, d.reason) == (A, LEAST_LOADED)
    d = router.choose([1, 2, 3], [Candidate(A, 0)])  # one engine with credit: no choice to make
    assert (d.engine, d.reason, d.matched) == (A, MATCH, 3)
    d = router.choose([7], [Candidate(A, 0)])
    assert (d.engine, d.reason, d.matched) == (A, LEAST_LOADED, 0)
    # equal matches: the least loaded of them
    router.index.reset(C, [1, 2, 3])
    d = router.choose([1, 2, 3], [Candidate(B, 0), Candidate(C, 1), Candidate(A, 2)])
    assert d.engine == C


def test_a_hot_prefix_spreads_over_the_engines_instead_of_piling_on_one(native):
    router = PrefixRouter(spill_ratio=1.5, spill_slack=2, native=native)
    router.index.reset(A, [1, 2])
    router.index.reset(B, [])
    running = {A: 0, B: 0}
    for _ in range(40):  # 40 requests for the same prefix, none finishing
        ranked = sorted((Candidate(e, n) for e, n in running.items()), key=lambda c: c.running)
        d = router.choose([1, 2], ranked)
        running[d.engine] += 1
        if d.reason == SPILL:
            router.index.update(d.engine, [1, 2], [])  # the engine that took it caches the prefix too
    assert max(running.values()) <= 1.5 * min(running.values()) + 3


# ---- the broker core ----

CONFIG = """
[broker]
heartbeat_interval_ms = 100
heartbeat_liveness = 5

[[models]]
name = "lm"
handler = "x:Y"
engines = 2
timeout_ms = 5000

[[models]]
name = "solo"
handler = "x:Y"
timeout_ms = 5000
"""


def make(native: bool = True) -> BrokerCore:
    core = BrokerCore(parse_config(CONFIG), epoch=1, generative=frozenset({"lm", "solo"}))
    if not native:
        core.routes.routers["lm"] = PrefixRouter(native=False)  # as a broker without a C compiler routes
    return core


def hello(core: BrokerCore, worker: bytes, hashes: list[int], model: str = "lm", now: float = 0.0) -> None:
    core.on_work(worker, Hello(worker.decode(), 1, "engine", [model], 8, kv_blocks=100, block_hashes=hashes), now)
    core.flush()


SENT: dict[int, tuple[bytes, int]] = {}  # req_id -> (engine, batch id) of the last submit()


def submit(core: BrokerCore, req_id: int, hashes: list[int], model: str = "lm", now: float = 0.0) -> bytes:
    """Submit one sequence and dispatch it: the engine it went to. Its hashes go as frontends send them (packed)
    for an even ``req_id``, and as older frontends did (a list) for an odd one: the same route either way."""
    blocks = {"block_hashes_packed": pack(hashes)} if req_id % 2 == 0 else {"block_hashes": hashes}
    core.on_client(b"cl", Submits([Submit(req_id, model, **blocks)], [1]), [b"{}"], now)
    core.tick(now)
    [send] = [w for w in core.flush()[1] if isinstance(w.header, Batch)]
    SENT[req_id] = (send.worker_id, send.header.batch_id)
    return send.worker_id


def finish(core: BrokerCore, req_id: int, now: float) -> None:
    worker, batch_id = SENT[req_id]
    core.on_out(StepOutput(worker.decode(), [batch_id], [""], [1], [True], [0], [""], [1]), [b"{}"], now)
    core.flush()


def deltas(worker: bytes, stored: list[int], evicted: list[int]) -> StepOutput:
    return StepOutput(worker.decode(), [], [], [], [], [], [], [], stored_blocks=stored, evicted_blocks=evicted)


def routing(core: BrokerCore, model: str = "lm") -> dict[str, tuple[int, ...]]:
    core.on_client(b"h", HealthQuery(1), [], 0.0)
    [send] = [c for c in core.flush()[0] if c.identity == b"h"]
    [health] = [m for m in send.header.models if m.name == model]
    return {r.engine: (r.prompt_blocks, r.cached_blocks, r.match, r.spill, r.least_loaded) for r in health.routing}


def test_the_broker_routes_by_the_hellos_snapshots_and_the_step_deltas(native):
    core = make(native)
    hello(core, A, [])
    hello(core, B, [11, 12])  # a restarted broker learns B's cache from its Hello
    assert submit(core, 1, [11, 12, 13]) == B
    assert submit(core, 2, [21, 22]) == A  # held nowhere: the least loaded
    finish(core, 1, 0.05)  # B runs nothing now, A one
    # A is computing [21, 22] (no step message yet): the next prompt starting so goes there, not to idle B
    assert submit(core, 3, [21, 22, 23], now=0.1) == A
    core.on_out(deltas(A, [21, 22, 23], []), [], 0.2)  # A's steps report what it allocated
    finish(core, 2, 0.2)
    finish(core, 3, 0.2)
    assert submit(core, 4, [21, 22, 23, 24], now=0.3) == A  # held: reported, nothing in flight any more
    finish(core, 4, 0.3)
    core.on_out(deltas(A, [], [23, 22, 21]), [], 0.4)  # evicted: A holds it no more
    assert core.routes.routers["lm"].index.matches([21, 22], [A, B]) == {A: 0, B: 0}
    assert len(core.routes.routers["lm"].inflight) == 0
    submit(core, 5, [21], now=0.5)  # held nowhere: by load
    assert routing(core) == {"a": (9, 5, 2, 0, 1), "b": (4, 2, 1, 0, 1)}


def test_a_lost_engines_entries_go_at_once_and_its_sequences_are_redispatched(native):
    core = make(native)
    hello(core, A, [])
    hello(core, B, [11, 12])
    assert submit(core, 1, [11, 12]) == B
    core.tick(0.3)  # both silent since 0.0 but within liveness (0.5 s)
    core.on_out(deltas(A, [], []), [], 0.4)  # A alive; B will be lost
    core.tick(0.6)
    _, work = core.flush()
    [again] = [w for w in work if isinstance(w.header, Batch)]
    assert again.worker_id == A  # the sequence went again, to the engine left
    index = core.routes.routers["lm"].index
    assert index.matches([11, 12], [B]) == {B: 0} and len(index) == 0
    # what B was computing went with it; the re-dispatched sequence is A's now
    assert core.routes.routers["lm"].inflight.matches([11, 12], [A, B]) == {A: 2, B: 0}


def test_in_flight_prompts_count_each_sequence_and_go_with_it():
    inflight = InFlightPrompts()
    inflight.add(1, A, [1, 2, 3])
    inflight.add(2, A, [1, 2])
    inflight.add(3, B, [1])
    assert inflight.matches([1, 2, 3, 4], [A, B, C]) == {A: 3, B: 1, C: 0}
    assert set(inflight.engines_at(1)) == {A, B}
    inflight.remove(1)
    assert inflight.matches([1, 2, 3], [A]) == {A: 2}  # sequence 2 still computes [1, 2]
    inflight.add(2, B, [1, 2])  # re-dispatched to B
    assert inflight.matches([1, 2], [A, B]) == {A: 0, B: 2} and set(inflight.engines_at(1)) == {B}
    inflight.drop(B)
    assert len(inflight) == 0 and list(inflight.engines_at(1)) == []
    inflight.remove(99)  # unknown: nothing to do


def test_in_flight_identical_prompts_and_the_compared_bound():
    inflight = InFlightPrompts()
    inflight.add(1, A, [1, 2, 3])
    inflight.add(2, A, [1, 2, 3])  # an equal prompt (another list): removing either leaves the other
    inflight.remove(1)
    assert inflight.matches([1, 2, 3], [A]) == {A: 3}
    inflight.remove(2)
    assert inflight.matches([1, 2, 3], [A]) == {A: 0}
    inflight.add(3, A, [1, 2, 3, 4])
    for i in range(InFlightPrompts.MAX_COMPARED):  # later prompts under the same first block, shorter matches
        inflight.add(10 + i, A, [1, 5 + i])
    # only the last MAX_COMPARED are compared: a worse route at worst, never a wrong answer
    assert inflight.matches([1, 2, 3, 4], [A]) == {A: 1}
    inflight.remove(10)
    assert inflight.matches([1, 2, 3, 4], [A]) == {A: 4}


def test_a_model_with_one_engine_is_not_routed(native):
    core = make(native)
    assert set(core.routes.routers) == {"lm"}  # "solo" has engines = 1: least_loaded, no index, no counters
    hello(core, A, [1, 2], model="solo")
    assert submit(core, 1, [1, 2], model="solo") == A
    assert routing(core, "solo") == {}


def test_routing_option_overrides_the_default():
    config = parse_config(CONFIG.replace('engines = 2\n', 'engines = 2\nrouting = "least_loaded"\n')
                          .replace('name = "solo"\n', 'name = "solo"\nrouting = "cache_aware"\n'))  # fmt: skip
    core = BrokerCore(config, epoch=1, generative=frozenset({"lm", "solo"}))
    assert set(core.routes.routers) == {"solo"}


def test_the_benchmarks_one_engine_hit_rate_counts_each_shared_block_once():
    from bench.generation.routing import ideal_hit_rate
    from bench.generation.workload import GenRequest

    a = GenRequest("", list(range(40)), 1)  # 2 shareable blocks of 16 (the third holds the last token)
    b = GenRequest("", list(range(32)) + [99] * 8, 1)  # shares both with a
    c = GenRequest("", [7] * 40, 1)  # shares nothing
    assert ideal_hit_rate([a, b, c], 16) == 32 / 120


# ---- the fast path against the policy as written (per engine, block by block) ----


def _reference(router: PrefixRouter, hashes: list[int], candidates: list[Candidate]) -> tuple[bytes, str, int]:
    """The policy spelled out: each candidate's leading blocks held (walked one by one) or computed (compared
    with its last MAX_COMPARED prompts in flight, one by one), the most of them, then the fewest running."""

    def leading(held) -> int:
        n = 0
        while n < len(hashes) and held(n):
            n += 1
        return n

    def computing(engine: bytes) -> int:
        in_flight = list(((router.inflight.at(hashes[0]) or {}).get(engine) or {}).values())
        prompts = in_flight[-InFlightPrompts.MAX_COMPARED :]
        return max((leading(lambda i, p=p: i < len(p) and p[i] == hashes[i]) for p in prompts), default=0)

    matched = {
        c.engine: max(leading(lambda i, e=c.engine: router.index.holds(e, hashes[i])), computing(c.engine))
        for c in candidates
    }
    least, best = candidates[0], candidates[0]
    for c in candidates:
        if matched[c.engine] > matched[best.engine] or (
            matched[c.engine] == matched[best.engine] and c.running < best.running
        ):
            best = c
    if not matched[best.engine]:
        return least.engine, LEAST_LOADED, 0
    if best.running > router.spill_ratio * least.running + router.spill_slack:
        return least.engine, SPILL, matched[least.engine]
    return best.engine, MATCH, matched[best.engine]


def _random_router(rng: random.Random, engines: list[bytes], native: bool) -> tuple[PrefixRouter, list[list[int]]]:
    """Engines holding prefixes of chains that share prefixes (as a cache holds them), some evicted from their
    ends, and prompts in flight."""
    router = PrefixRouter(spill_ratio=rng.choice([1.0, 1.5, 3.0]), spill_slack=rng.choice([0, 2]), native=native)
    trunks = [[rng.getrandbits(64) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    prompts = [t[: rng.randrange(1, len(t) + 1)] + [rng.getrandbits(64) for _ in range(rng.randrange(4))]
               for t in trunks for _ in range(4)]  # fmt: skip
    for engine in engines:
        router.index.reset(engine, [])
        for p in rng.sample(prompts, rng.randrange(4)):
            router.index.update(engine, p[: rng.randrange(len(p) + 1)], [])
    for engine in rng.sample(engines, 2):  # a chain evicted from its end
        p = rng.choice(prompts)
        router.index.update(engine, [], reversed(p[rng.randrange(len(p)) :]))
    for item_id in range(rng.randrange(6)):
        router.inflight.add(item_id, rng.choice(engines), rng.choice(prompts))
    return router, prompts


def test_the_choice_is_the_policy_as_written_on_random_caches(native):
    rng = random.Random(7)
    engines = [bytes([97 + i]) for i in range(6)]
    for _ in range(400):
        router, prompts = _random_router(rng, engines, native)
        running = {e: rng.randrange(5) for e in engines}
        chosen = rng.sample(engines, rng.randrange(1, len(engines) + 1))
        low = min(running[e] for e in chosen)
        chosen.sort(key=lambda e: running[e] > low)  # the least loaded first, the others in any order
        candidates = [Candidate(e, running[e]) for e in chosen]
        hashes = rng.choice(prompts) + [rng.getrandbits(64) for _ in range(rng.randrange(3))]
        assert tuple(router.choose(hashes, candidates)) == _reference(router, hashes, candidates)


def test_route_takes_the_least_loaded_and_the_first_blocks_holders_with_credit(native):
    rng = random.Random(11)
    engines = [bytes([97 + i]) for i in range(6)]
    for _ in range(300):
        router, prompts = _random_router(rng, engines, native)
        workers = {e: Worker(e, e.decode(), 1, "engine", ("lm",), 2, 0.0) for e in engines}
        for w in workers.values():
            for batch_id in range(rng.randrange(3)):  # 2 credits: some engines have none left
                w.in_flight[batch_id] = InFlightBatch(batch_id, "lm", [batch_id], w.worker_id, 0.0)
        free = [w for w in workers.values() if w.free_credits > 0]
        if not free:
            continue
        least = min(free, key=lambda w: len(w.in_flight))
        hashes = rng.choice(prompts)
        # the candidates as the broker gathers them: the least loaded, then the engines holding the first block
        # or computing it, by slot, each once and only with a free slot
        candidates = [Candidate(least.worker_id, len(least.in_flight))]
        others = {*router.index.holders(hashes[0]), *router.inflight.engines_at(hashes[0])} - {least.worker_id}
        for e in sorted(others, key=router.index.bit):
            if workers[e].free_credits > 0:
                candidates.append(Candidate(e, len(workers[e].in_flight)))
        assert router.route(hashes, least, workers) == _reference(router, hashes, candidates)
    assert router.route([], least, workers) == (least.worker_id, LEAST_LOADED, 0)


def test_longest_searches_every_engine_at_once(native):
    index = new_index(native)
    index.reset(A, [1, 2, 3, 4])
    index.reset(B, [1, 2, 3, 4, 5])
    index.reset(C, [1, 2])
    a, b, c = index.bit(A), index.bit(B), index.bit(C)
    assert index.longest([1, 2, 3, 4, 5, 6], a | b | c) == (5, b)
    assert index.longest([1, 2, 3, 4, 5, 6], a | c) == (4, a)
    index.reset(C, [1, 2, 3, 4])
    assert index.longest([1, 2, 3, 4, 9], a | b | c) == (4, a | b | c)  # all three hold 4 blocks
    assert index.longest([1, 2, 3, 4, 9], 0) == (0, 0) and index.longest([], a) == (0, 0)
    assert index.longest([7, 1], a | b | c) == (0, 0)


def test_a_freed_slot_goes_to_the_next_engine_with_nothing_of_the_last_ones(native):
    index = new_index(native)
    index.reset(A, [1, 2])
    index.reset(B, [1, 3])
    bit = index.bit(A)
    index.drop(A)
    assert index.bit(A) == 0 and index.holders(1) == [B] and index.mask(2) == 0  # gone at once, every entry
    index.reset(C, [4])  # takes A's slot
    assert index.bit(C) == bit and index.holders(1) == [B] and index.holders(4) == [C]
    assert index.matches([1, 2], [A, B, C]) == {A: 0, B: 1, C: 0} and len(index) == 3

"""The routing index in C (zserve.batching.prefix_table) against the dict index (zserve.batching.prefix_index):
the same contents and answers after thousands of random operations (snapshots, stores, evictions, lost deltas
past an engine's bound, log compaction, engine loss, hash 0 and 2**64 - 1), the same decisions from a router
on each (in-flight prompts, spill, engines without credit), the move to the dict index past 64 engines, and the
dict index when no C compiler is found."""

from __future__ import annotations

import gc
import logging
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zserve.batching import prefix_table
from zserve.batching.prefix_hash import pack
from zserve.batching.prefix_index import MIN_ENTRIES, PrefixIndex, bound
from zserve.batching.routing import InFlightPrompts, PrefixRouter
from zserve.batching.workers import InFlightBatch, Worker

CIndex = prefix_table.native_index()


def _skipped() -> bool:
    """Whether the C tests are skipped: only where the build cannot run (no compiler or headers, and
    ZSERVE_REQUIRE_C_INDEX unset); where it can, a build that fails fails them."""
    return prefix_table.native_index() is None and not prefix_table.buildable()


pytestmark = pytest.mark.skipif(_skipped(), reason="no C compiler or Python headers here")


def test_the_c_index_is_built_where_it_can_be():
    assert CIndex is not None, "a C compiler and Python.h are here, but the routing index did not build (see log)"


def test_a_broken_build_fails_the_tests_where_a_compiler_is_found(monkeypatch, tmp_path):
    # a build that fails (a broken compiler, a bad edit of the C source) skipped every C test: 17 passed, 20 skipped
    cc = tmp_path / "brokencc"
    cc.write_text("#!/bin/sh\necho 'error: broken' >&2\nexit 1\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("ZSERVE_CACHE_DIR", str(tmp_path))
    prefix_table.module.cache_clear()
    prefix_table.native_index.cache_clear()
    try:
        assert prefix_table.native_index() is None and not _skipped()
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
        prefix_table.module.cache_clear()
        prefix_table.native_index.cache_clear()
        assert _skipped()  # no compiler at all: skipped...
        monkeypatch.setenv("ZSERVE_REQUIRE_C_INDEX", "1")
        assert not _skipped()  # ...unless the C index is required (CI)
    finally:
        prefix_table.module.cache_clear()
        prefix_table.native_index.cache_clear()


TOP = 2**64 - 1


def _same(c: PrefixIndex, py: PrefixIndex, rng: random.Random, pool: list[int], engines: list[bytes]) -> None:
    assert len(c) == len(py)
    assert [e for e in c.export() if e] == [e for e in py.export() if e]  # each engine's hashes, in order
    for engine in engines:
        assert c.bit(engine) == py.bit(engine) and c.log_size(engine) == py.log_size(engine)
    for h in rng.sample(pool, 20):
        assert c.mask(h) == py.mask(h) and c.holders(h) == py.holders(h)
    mask = 0  # the bits of some live engines (what callers pass)
    for engine in rng.sample(engines, rng.randrange(len(engines) + 1)):
        mask |= py.bit(engine)
    assert c.engines_in(mask) == py.engines_in(mask)
    for _ in range(5):
        hashes = rng.sample(pool, rng.randrange(0, 12))
        assert c.longest(hashes, mask) == py.longest(hashes, mask)
        assert c.matches(hashes, engines) == py.matches(hashes, engines)


def test_the_c_index_holds_and_answers_as_the_dict_index_over_random_operations():
    rng = random.Random(3)
    engines = [f"engine-{i}".encode() for i in range(5)]
    pool = [0, TOP, *(rng.getrandbits(64) for _ in range(2000)), *range(1, 2000)]  # shared hashes: masks of many bits
    c, py = CIndex(), PrefixIndex()
    compacted = trimmed = 0
    for step in range(3000):
        engine = rng.choice(engines)
        op = rng.random()
        if op < 0.005:
            snapshot = rng.sample(pool, rng.randrange(0, 300))
            kv_blocks = rng.choice([0, 10, MIN_ENTRIES + 100])
            c.reset(engine, snapshot, kv_blocks)
            py.reset(engine, snapshot, kv_blocks)
        elif op < 0.01:
            c.drop(engine)
            py.drop(engine)
        else:  # a step's deltas: some of what it holds evicted (some twice, some never held), new blocks stored
            held = py._held[engine].log[-200:] if engine in py._held else []  # some since evicted: again
            evicted = rng.sample(held, min(len(held), rng.randrange(0, 45))) + rng.sample(pool, rng.randrange(3))
            stored = rng.sample(pool, rng.randrange(0, 60))
            stored += stored[: rng.randrange(3)]  # reported twice in one message
            before = py.log_size(engine)
            c.update(engine, stored, evicted)
            py.update(engine, stored, evicted)
            if engine in py._held:
                full = py._held[engine].count == py._held[engine].limit
                trimmed += full
                compacted += not full and py.log_size(engine) < before
        if step % 25 == 0:
            _same(c, py, rng, pool, engines)
    _same(c, py, rng, pool, engines)
    assert compacted > 5 and trimmed > 5, (compacted, trimmed)  # both bounds were reached, not only plain paths
    for engine in engines:
        c.drop(engine)
        py.drop(engine)
    assert len(c) == 0 and all(c.mask(h) == 0 for h in pool)  # a lost engine's entries go, every one


def test_the_c_index_compacts_its_log_and_keeps_it_within_twice_its_bound():
    c = CIndex()
    c.reset(b"a", [], kv_blocks=MIN_ENTRIES)
    for start in range(0, 20 * MIN_ENTRIES, 8):  # stored and evicted, as a full engine reports them
        c.update(b"a", range(start, start + 8), range(start - MIN_ENTRIES, start - MIN_ENTRIES + 8))
        assert c.log_size(b"a") <= 2 * MIN_ENTRIES
    # evicted hashes leave the table: at most 4 slots of 16 bytes an entry held (it is kept under half full)
    assert len(c) == MIN_ENTRIES and c.table_bytes() <= 64 * MIN_ENTRIES


def _workers(rng: random.Random, engines: list[bytes]) -> dict[bytes, Worker]:
    workers = {e: Worker(e, e.decode(), 1, "engine", ("lm",), 3, 0.0) for e in engines}
    for w in workers.values():
        for batch_id in range(rng.randrange(4)):  # 3 credits: some engines have none left
            w.in_flight[batch_id] = InFlightBatch(batch_id, "lm", [batch_id], w.worker_id, 0.0)
        w.leaving = rng.random() < 0.05
    return workers


def _drive(rng: random.Random, engines: list[bytes], steps: int) -> tuple[PrefixRouter, PrefixRouter]:
    """Two routers, C and dict, fed the same random life: Hellos, deltas, engines lost, sequences routed and
    finished; every decision must be the same."""
    ratio, slack = rng.choice([1.0, 1.5, 3.0]), rng.choice([0, 2])
    c, py = PrefixRouter(ratio, slack), PrefixRouter(ratio, slack, native=False)
    assert c._route_c is not None and py._route_c is None
    trunks = [[rng.getrandbits(64) for _ in range(rng.randrange(1, 40))] for _ in range(12)]
    prompts = [t[: rng.randrange(1, len(t) + 1)] + [rng.getrandbits(64) for _ in range(rng.randrange(4))]
               for t in trunks for _ in range(6)]  # fmt: skip
    routed: list[int] = []
    for step in range(steps):
        engine, op = rng.choice(engines), rng.random()
        if op < 0.05:
            snapshot = [h for p in rng.sample(prompts, rng.randrange(4)) for h in p[: rng.randrange(len(p) + 1)]]
            for r in (c, py):
                r.reset(engine, snapshot, rng.choice([0, 50]))
        elif op < 0.08:
            for r in (c, py):
                r.drop(engine)
        elif op < 0.4:
            p = rng.choice(prompts)
            stored = p[: rng.randrange(len(p) + 1)]
            evicted = list(reversed(p[rng.randrange(len(p) + 1) :])) if rng.random() < 0.3 else []
            for r in (c, py):
                r.index.update(engine, stored, evicted)
        elif op < 0.55 and routed:
            item_id = routed.pop(rng.randrange(len(routed)))
            for r in (c, py):
                if rng.random() < 0.5:
                    r.inflight.remove(item_id)
                else:
                    r.finish([item_id, 10**9])  # an unknown one: nothing to do
        else:
            workers = _workers(rng, engines)
            free = [w for w in workers.values() if w.free_credits > 0]
            if not free:
                continue
            least = min(free, key=lambda w: len(w.in_flight))
            hashes = rng.choice(prompts) + [rng.getrandbits(64) for _ in range(rng.randrange(3))]
            if rng.random() < 0.05:
                hashes = []
            if rng.random() < 0.5:  # some stay in flight: later prompts compare with them
                item_id = rng.choice(routed) if routed and rng.random() < 0.1 else step  # or again, elsewhere
                sent = pack(hashes) if rng.random() < 0.5 else hashes  # as frontends send them, or older ones
                decision = c.dispatch(item_id, sent, least, workers)
                assert decision == py.dispatch(item_id, sent, least, workers), step
                routed.append(item_id)
            else:
                decision = c.route(hashes, least, workers)
                assert decision == py.route(hashes, least, workers), step
        assert len(c.inflight) == len(py.inflight), step
    assert sorted(c.inflight.flights()) == sorted(py.inflight.flights())
    # the C index's counters (of engines it holds, and of those dropped since) are the dict index's
    assert c.report() == py.report() and sum(n.decisions["match"] for n in c.report().values()) > 0
    return c, py


def test_a_router_on_the_c_index_decides_as_one_on_the_dict_index():
    rng = random.Random(5)
    engines = [bytes([97 + i]) for i in range(8)]
    for _ in range(4):
        c, py = _drive(rng, engines, 1000)
        assert [e for e in c.index.export() if e] == [e for e in py.index.export() if e]


def test_past_64_engines_the_router_moves_to_the_dict_index_with_every_entry(caplog):
    rng = random.Random(9)
    engines = [f"e{i}".encode() for i in range(70)]
    c, py = PrefixRouter(), PrefixRouter(native=False)
    for i, engine in enumerate(engines[:64]):
        for r in (c, py):
            r.reset(engine, [i, 1000 + i % 4], 0)
    for r in (c, py):
        r.drop(engines[3])  # a free slot below the top: the 65th engine takes it, the 66th needs a 65th slot
        r.reset(engines[64], [5000], 0)
    assert c._route_c is not None  # 64 engines still
    workers = {e: Worker(e, e.decode(), 1, "engine", ("lm",), 2, 0.0) for e in engines}
    for item_id in range(100):  # in flight when the index moves: they move with it
        hashes = [rng.randrange(70), 1000 + rng.randrange(4), rng.randrange(3)]
        least = workers[rng.choice(engines[:65])]
        assert c.dispatch(item_id, hashes, least, workers) == py.dispatch(item_id, hashes, least, workers)
    assert len(c.inflight) > 0
    with caplog.at_level(logging.WARNING, "zserve.broker"):
        for r in (c, py):
            r.reset(engines[65], [5001, 1000], 0)
    assert c._route_c is None and type(c.index) is PrefixIndex and "moves to Python" in caplog.text
    assert c.index.export() == py.index.export() and len(c.index) == len(py.index)
    assert c.index.bit(engines[65]) == 1 << 64 and c.index.holders(1000)[-1] == engines[65]
    assert sorted(c.inflight.flights()) == sorted(py.inflight.flights()) and type(c.inflight) is InFlightPrompts
    assert c.report() == py.report() and c.report()
    for _ in range(200):
        hashes = [rng.randrange(70), 1000 + rng.randrange(4)]
        least = workers[rng.choice(engines)]
        assert c.route(hashes, least, workers) == py.route(hashes, least, workers)


def test_without_a_compiler_the_dict_index_serves_and_says_so_once(monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    prefix_table.module.cache_clear()
    prefix_table.native_index.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, "zserve.broker"):
            routers = [PrefixRouter() for _ in range(3)]
        assert all(type(r.index) is PrefixIndex and r._route_c is None for r in routers)
        assert caplog.text.count("no C compiler") == 1
    finally:
        prefix_table.module.cache_clear()
        prefix_table.native_index.cache_clear()


def test_the_module_is_built_once_into_the_cache_folder_and_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("ZSERVE_CACHE_DIR", str(tmp_path))
    prefix_table.module.cache_clear()
    try:
        built = prefix_table.module()
        assert built is not None
        [so] = (tmp_path / "kernels").glob("*.so")
        assert so.name.startswith(prefix_table.NAME) and so.with_name(so.name + ".sha256").exists()
        mtime = so.stat().st_mtime_ns
        prefix_table.module.cache_clear()
        assert prefix_table.module() is not None and so.stat().st_mtime_ns == mtime  # loaded, not built again
    finally:
        prefix_table.module.cache_clear()


def test_the_broker_builds_its_index_without_importing_torch():
    # the C index is built with the kernels' compile step (zserve.generator.c_build); the broker must stay light
    code = (
        "import sys; from zserve.batching.routing import PrefixRouter; r = PrefixRouter();"
        "assert r._route_c is not None; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("size", [0, 4096])
def test_a_damaged_cached_build_is_built_again_not_loaded(monkeypatch, tmp_path, size):
    # a .so cut short (a crash after the build, a bad copy): loading it died of SIGBUS in dlopen (4 KiB) or ran
    # the dict index for good (empty); its seal no longer matches, so it is built again and the C index serves
    monkeypatch.setenv("ZSERVE_CACHE_DIR", str(tmp_path))
    prefix_table.module.cache_clear()
    try:
        assert prefix_table.module() is not None
    finally:
        prefix_table.module.cache_clear()
    [so] = (tmp_path / "kernels").glob("*.so")
    whole = so.stat().st_size
    cut = so.with_name("cut")  # a new file: this process maps the old one, which must stay whole
    cut.write_bytes(so.read_bytes()[:size])
    cut.replace(so)
    code = "from zserve.batching.routing import PrefixRouter; assert PrefixRouter()._route_c is not None"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert so.stat().st_size == whole


def test_a_compiler_that_hangs_is_given_up_on_and_the_dict_index_serves(monkeypatch, tmp_path, caplog):
    # a broker must start within its liveness probe: the build is killed (the compiler's children too)
    pid_file = tmp_path / "child.pid"
    cc = tmp_path / "hangcc"
    cc.write_text(f"#!/bin/sh\nsleep 60 &\necho $! > {pid_file}\nwait\n")
    cc.chmod(0o755)
    monkeypatch.setenv("ZSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setattr(prefix_table, "BUILD_TIMEOUT_S", 0.5)
    prefix_table.module.cache_clear()
    prefix_table.native_index.cache_clear()
    try:
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, "zserve.broker"):
            router = PrefixRouter()
        assert time.monotonic() - start < 5 and router._route_c is None
        assert "timed out" in caplog.text
    finally:
        prefix_table.module.cache_clear()
        prefix_table.native_index.cache_clear()
    stat = Path(f"/proc/{int(pid_file.read_text())}/stat")
    assert not stat.exists() or stat.read_text().split(") ")[1][0] == "Z"  # killed with its parent (or a zombie)


def _unmix(y: int) -> int:
    """The inverse of MurmurHash3's 64-bit finaliser (what keys the C table's home slots)."""
    m = 2**64 - 1
    y ^= y >> 33
    y = (y * pow(0xC4CEB9FE1A85EC53, -1, 2**64)) & m
    y ^= y >> 33
    y = (y * pow(0xFF51AFD7ED558CCD, -1, 2**64)) & m
    return y ^ (y >> 33)


def test_crafted_block_hashes_do_not_pile_up_in_one_probe_run():
    # block hashes are public: a client can grind prompts whose blocks share a home slot; 4,000 such entries made
    # one run of 4,000 slots that every lookup landing in it scanned. Keyed by a random seed, they spread.
    rng = random.Random(11)
    golden = [(pow(0x9E3779B97F4A7C15, -1, 2**64) * ((0xABC << 52) | rng.getrandbits(52))) % 2**64 for _ in range(4000)]
    seeded0 = [_unmix((0xABC << 52) | rng.getrandbits(52)) for _ in range(4000)]  # a cluster if the seed is 0
    for crafted in (golden, seeded0):
        c = CIndex()
        c.reset(b"a", crafted, 2 * len(crafted))
        assert len(c) == len(crafted) and c.longest_run() < 200
    c = CIndex(seed=0)
    c.reset(b"a", seeded0, 2 * len(seeded0))
    assert c.longest_run() >= len(seeded0)  # the seed is what keys the homes


class _Hooked:
    """A worker whose free_credits runs Python code (``hook``), as a property may: route must hold what it reads."""

    def __init__(self, worker_id: bytes, hook=None) -> None:
        self.worker_id, self.in_flight, self.hook = worker_id, {}, hook

    @property
    def free_credits(self) -> int:
        if self.hook is not None:
            self.hook()
        return 1


def test_route_holds_what_it_reads_across_the_python_code_it_runs():
    # a worker's property dropped its engine from the index and the pool, and changed the hashes' list: route
    # read the freed engine and the list's old item array (a segfault), where it must read what is there now
    c = CIndex()
    engine = b"".join([b"engine-", b"12345"])  # an object only this test, the index and the pool hold
    c.reset(engine, [11, 12, 13], 0)
    hashes = [11, 12, 13]
    least = _Hooked(b"least")

    def hook() -> None:
        nonlocal engine
        c.drop(engine)
        c.reset(b"other", [11, 12, 13], 0)
        workers.pop(engine)
        del engine
        gc.collect()
        hashes[:] = [11, 12] + [random.getrandbits(64) for _ in range(5000)]  # a new item array
        for _ in range(1000):
            bytes(20)

    workers = {engine: _Hooked(engine, hook), b"least": least}
    decision = c.route(hashes, least, workers, 10.0, 10, 8)
    assert decision == (b"least", "least_loaded", 0)  # the candidate is gone, its slot another engine's
    workers = {b"least": least, b"other": _Hooked(b"other")}
    assert c.route(hashes, least, workers, 10.0, 10, 8) == (b"other", "match", 2)
    # the prompts in flight, changed as the engines computing them are read: read after, as they are then
    c.reset(b"computing", [], 0)
    c.fly(1, b"computing", [11, 12, 99])
    c.fly(2, b"other", [11, 12, 13, 14])
    workers[b"computing"] = _Hooked(b"computing", lambda: c.land([2]))
    hashes = [11, 12, 13, 14]
    assert c.route(hashes, least, workers, 10.0, 10, 8) == (b"other", "match", 3)  # held, no more computed: 4

    def grow() -> None:  # hundreds more in flight: the pools move in memory
        for i in range(100, 400):
            c.fly(i, b"computing", [11, 12, 13, 14, i])

    workers[b"computing"].hook = grow
    assert c.route(hashes, least, workers, 10.0, 10, 8) == (b"computing", "match", 4)
    assert c.in_flight() == 301 and c.computing(hashes, b"computing", 8) == 4
    c.land(range(100, 400))
    assert c.in_flight() == 1 and c.computing(hashes, b"computing", 8) == 2
    with pytest.raises(TypeError, match="must be an int"):
        c.longest([11, "12"], 1)
    with pytest.raises(TypeError, match="must be an int"):
        c.dispatch(5, [11, None], least, workers, 10.0, 10, 8)
    assert c.in_flight() == 1  # nothing kept of a refused call


@pytest.mark.parametrize("kv_blocks", [2**62, sys.maxsize, 2**64 - 1])
def test_an_engine_reporting_a_huge_pool_is_bounded_alike_in_both_indexes(kv_blocks):
    # a Hello's kv_blocks past 2**62 overflowed 2 * limit in C: its log was compacted on every step message
    # (quadratic) and the C and dict indexes kept different bounds and logs
    rng = random.Random(kv_blocks)
    c, py = CIndex(), PrefixIndex()
    for index in (c, py):
        index.reset(b"e", [], kv_blocks)
    stored: list[int] = []
    for _ in range(300):
        new = [rng.getrandbits(64) for _ in range(4)]
        evicted = rng.sample(stored, min(2, len(stored)))
        stored += new
        for index in (c, py):
            index.update(b"e", new, evicted)
    assert c.export()[0][1] == py.export()[0][1] == bound(kv_blocks)
    assert c.log_size(b"e") == py.log_size(b"e") == len(stored) and len(c) == len(py)


def test_prompts_in_flight_on_engines_without_a_slot_are_kept_by_neither_index():
    c, py = PrefixRouter(), PrefixRouter(native=False)
    engines = [f"e{i}".encode() for i in range(70)]  # 6 of them without a Hello
    workers = {e: Worker(e, e.decode(), 1, "engine", ("lm",), 2, 0.0) for e in engines}
    for i, engine in enumerate(engines[:64]):
        for r in (c, py):
            r.reset(engine, [7, 100 + i], 0)
    for i, engine in enumerate(engines):
        least = workers[engine]
        for r in (c, py):
            r.dispatch(i, [7, 8, 9][: 1 + i % 3], least, {engine: least})  # each to its own engine
    assert len(c.inflight) == len(py.inflight) == 64
    least = workers[engines[0]]
    assert c.route([7, 8, 9], least, workers) == py.route([7, 8, 9], least, workers) == (b"e2", "match", 3)


class _Collected:
    """Garbage in a cycle whose finalizer runs ``then`` (Python code) when a collection finds it: the collection
    runs at whatever allocation crosses the threshold, so inside any C call that makes a Python object."""

    def __init__(self, then) -> None:
        self.me, self.then = self, then

    def __del__(self) -> None:
        self.then()


def _at_each_threshold(run, thresholds=range(1, 12)):
    old = gc.get_threshold()
    # The heap as it is set aside (gc.freeze): each collection below walks only what the test makes. In the
    # suite's process (torch, transformers and the rest loaded) a full collection took 0.3-0.5 s, and these loops
    # took 13 s a test in CI; collections come at the same allocations (the counts are the same), so each
    # threshold catches what it did (reverting d131517's F1 segfaults at 5-8 and 11, F2 fails at 1-4 and 6-8).
    gc.freeze()
    try:
        for threshold in thresholds:
            gc.collect()
            gc.set_threshold(threshold)
            run(threshold)
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()


def test_flights_copies_what_it_lists_before_a_collection_can_land_them():
    # flights() made its lists while it walked the flights: a finalizer landing them left it reading freed memory
    # (SIGSEGV; ASan: heap-use-after-free in hash_list)
    def run(threshold: int) -> None:
        c = CIndex(seed=1)
        c.reset(b"a", [], 0)
        for i in range(10):
            c.fly(i, b"a", [5, i, i + 1])
        gc.disable()
        _Collected(lambda: c.land(range(10)))
        gc.enable()
        # as they were when it was called (or none, where the collection came before the call)
        assert sorted(c.flights()) in ([(i, b"a", [5, i, i + 1]) for i in range(10)], []), threshold
        gc.collect()
        assert c.flights() == [] and c.in_flight() == 0

    _at_each_threshold(run)


def test_dispatch_keeps_nothing_on_an_engine_dropped_while_its_decision_is_made():
    # the decision's tuple is made after choose's last read; a finalizer it set off dropped the chosen engine, and
    # the sequence was put in flight and counted on its free slot, which the next engine to register inherited
    def run(threshold: int) -> None:
        c = CIndex(seed=1)
        c.reset(b"least", [], 0)
        c.reset(b"a", [11, 12, 13], 0)

        def hook() -> None:
            gc.disable()
            _Collected(lambda: c.drop(b"a"))
            gc.enable()

        least = _Hooked(b"least")
        decision = c.dispatch(7, [11, 12, 13], least, {b"least": least, b"a": _Hooked(b"a", hook)}, 10.0, 10, 8)
        gc.collect()
        if c.bit(b"a") == 0:  # dropped meanwhile: nothing of the sequence kept or counted anywhere
            assert c.in_flight() == 0 and c.flights() == [] and all(sum(n[1:]) == 0 for n in c.counts())
            c.reset(b"newcomer", [], 0)
            assert c.computing([11, 12, 13], b"newcomer", 8) == 0 and c.counts()[-1][1:] == (0, 0, 0, 0, 0)
        else:
            assert decision == (b"a", "match", 3) and c.flights() == [(7, b"a", [11, 12, 13])], threshold

    _at_each_threshold(run)

from __future__ import annotations

from zserve.batching.workers import WorkerPool


def test_silent_workers_expire_with_their_batches():
    pool = WorkerPool(liveness_s=1.0)
    pool.register(b"a", name="a", pid=1, role="engine", models=["m"], credits=2, now=0.0)
    pool.register(b"b", name="b", pid=2, role="engine", models=["m"], credits=2, now=0.0)
    batch = pool.start(pool.workers[b"a"], 7, "m", [1, 2], now=0.1)
    assert pool.seen(b"b", 0.9)
    assert pool.expire(1.0) == []
    [(worker, batches)] = pool.expire(1.2)
    assert worker.name == "a" and batches == [batch]
    assert pool.finish(7) is None  # a late result of a lost batch is unknown
    assert not pool.seen(b"a", 1.3)  # and the worker must say Hello again


def test_finish_returns_credit_and_hello_again_orphans_batches():
    pool = WorkerPool(liveness_s=1.0)
    pool.register(b"a", name="a", pid=1, role="engine", models=["m"], credits=1, now=0.0)
    w = pool.workers[b"a"]
    pool.start(w, 1, "m", [1], 0.0)
    assert pool.best("m") is None
    assert pool.finish(1).item_ids == [1]
    assert pool.best("m") is w
    pool.start(w, 2, "m", [2], 0.0)
    orphans = pool.register(b"a", name="a", pid=1, role="engine", models=["m"], credits=1, now=0.5)
    assert [b.batch_id for b in orphans] == [2]
    assert pool.in_flight_items("m") == 0


def test_best_prefers_the_least_loaded_then_least_recently_used():
    pool = WorkerPool(liveness_s=1.0)
    for name in (b"a", b"b"):
        pool.register(name, name=name.decode(), pid=1, role="engine", models=["m"], credits=2, now=0.0)
    first = pool.best("m")
    pool.start(first, 1, "m", [1], 0.1)
    second = pool.best("m")
    assert second is not first
    pool.start(second, 2, "m", [2], 0.2)
    assert pool.best("m") is first  # both hold one batch; first was used longer ago
    assert pool.best("other") is None


def test_hung_looks_at_no_worker_until_one_can_have_stalled_past_the_shortest_timeout():
    pool = WorkerPool(liveness_s=10.0)
    for name in (b"a", b"b"):
        pool.register(name, name=name.decode(), pid=1, role="engine", models=["m"], credits=2, now=0.0)
    asked: list[str] = []

    def timeout_s(worker, stalled_s: float) -> float:
        asked.append(worker.name)
        return 1.0

    pool.start(pool.workers[b"a"], 1, "m", [1], now=0.0)
    assert pool.hung(0.5, timeout_s, shortest_s=0.5) == [] and asked == []  # 0.5 s stalled at most: no scan
    assert pool.hung(0.6, timeout_s, shortest_s=0.5) == [] and asked == ["a"]  # scanned: a, stalled 0.6 of 1.0
    pool.progressed(b"a", 0.9)
    pool.start(pool.workers[b"b"], 2, "m", [2], now=1.0)  # b's hang clock starts at 1.0
    asked.clear()
    assert pool.hung(1.2, timeout_s, shortest_s=0.5) == [] and sorted(asked) == ["a", "b"]  # floor was a's 0.0
    asked.clear()
    assert pool.hung(1.4, timeout_s, shortest_s=0.5) == [] and asked == []  # floor now a's 0.9: no scan
    assert [w.name for w in pool.hung(1.95, timeout_s, shortest_s=0.5)] == ["a"]  # a: 1.05 s > 1.0; b: 0.95 s
    pool.progressed(b"b", 0.2)  # a fake clock that went back: the floor follows it
    asked.clear()
    assert [w.name for w in pool.hung(1.3, timeout_s, shortest_s=0.5)] == ["b"] and "b" in asked

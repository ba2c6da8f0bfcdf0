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

"""The batching policy, driven by a fake clock (plain floats: the scheduler has no clock of its own)."""

from __future__ import annotations

from zserve.broker.scheduler import Admission, BatchPolicy, Scheduler
from zserve.broker.workers import WorkerPool


def make(max_batch_size: int = 4, max_wait_ms: float = 10.0, max_queue: int = 100, workers: int = 1, credits: int = 2):
    pool = WorkerPool(liveness_s=1.0)
    for i in range(workers):
        pool.register(f"w{i}".encode(), name=f"w{i}", pid=i, role="engine", models=["m"], credits=credits, now=0.0)
    return Scheduler({"m": BatchPolicy(max_batch_size, max_wait_ms, max_queue)}, pool), pool


def fill(s: Scheduler, ids: range, now: float) -> None:
    for i in ids:
        assert s.submit("m", i, now) is Admission.ACCEPTED


def test_idle_worker_takes_a_lone_request_at_once():
    s, _ = make()
    fill(s, range(1), now=0.0)
    [d] = s.pop_batches(now=0.0)
    assert d.item_ids == [0]


def test_busy_worker_waits_for_a_full_batch_by_count():
    s, _ = make(max_batch_size=4)
    fill(s, range(1), 0.0)
    s.pop_batches(0.0)  # the worker is now busy with one batch, one credit left
    fill(s, range(1, 4), 0.001)
    assert s.pop_batches(0.002) == []  # 3 < 4 and the window is open
    fill(s, range(4, 6), 0.003)
    [d] = s.pop_batches(0.003)
    assert d.item_ids == [1, 2, 3, 4]  # full by count, FIFO
    assert s.depth("m") == 1


def test_busy_worker_takes_a_partial_batch_when_the_wait_expires():
    s, _ = make(max_batch_size=8, max_wait_ms=10.0)
    fill(s, range(1), 0.0)
    s.pop_batches(0.0)
    fill(s, range(1, 3), 1.000)
    assert s.pop_batches(1.009) == []
    assert abs(s.next_wakeup_s(1.009) - 0.001) < 1e-9
    [d] = s.pop_batches(1.010)
    assert d.item_ids == [1, 2]


def test_no_dispatch_without_credit():
    s, pool = make(max_batch_size=2, credits=1)
    fill(s, range(5), 0.0)
    [d] = s.pop_batches(0.0)
    assert len(d.item_ids) == 2
    assert s.pop_batches(5.0) == []  # full and late, but the only worker has no credit
    assert s.next_wakeup_s(5.0) is None  # nothing but a result can make progress
    pool.finish(d.batch_id)
    [d2] = s.pop_batches(5.0)
    assert d2.item_ids == [2, 3]


def test_batches_spread_over_idle_workers():
    s, _ = make(max_batch_size=2, workers=2, credits=1)
    fill(s, range(4), 0.0)
    batches = s.pop_batches(0.0)
    assert [b.item_ids for b in batches] == [[0, 1], [2, 3]]
    assert {b.worker.name for b in batches} == {"w0", "w1"}


def test_queue_cap_and_unknown_model():
    s, _ = make(max_queue=3, workers=0)
    fill(s, range(3), 0.0)
    assert s.submit("m", 99, 0.0) is Admission.OVERLOADED
    assert s.submit("other", 100, 0.0) is Admission.UNKNOWN_MODEL
    assert s.depth("m") == 3


def test_requeued_items_go_first_and_removed_items_never_leave():
    s, _ = make(max_batch_size=3, workers=0)
    fill(s, range(3), 0.0)
    assert s.remove("m", 1)
    assert not s.remove("m", 1)
    s.requeue("m", 42, 0.0)
    s.pool.register(b"w", name="w", pid=1, role="engine", models=["m"], credits=1, now=0.0)
    [d] = s.pop_batches(0.0)
    assert d.item_ids == [42, 0, 2]


def test_max_wait_zero_dispatches_immediately_even_to_a_busy_worker():
    s, _ = make(max_batch_size=8, max_wait_ms=0.0)
    fill(s, range(2), 0.0)
    assert [d.item_ids for d in s.pop_batches(0.0)] == [[0, 1]]
    fill(s, range(2, 3), 0.0)
    assert [d.item_ids for d in s.pop_batches(0.0)] == [[2]]

"""Priorities with aging and weighted fair share (zserve.batching.fair_share), and the scheduler's use of them, on a
fake clock."""

from __future__ import annotations

import pytest

from zserve.batching.fair_share import FairQueue
from zserve.batching.scheduler import BatchPolicy, Scheduler
from zserve.batching.workers import ENGINE, WorkerPool


def _served_shares(weights: dict[str, float], rates: dict[str, int], costs: dict[str, int]) -> dict[str, float]:
    """Both tenants backlogged: each step, tenant X adds rates[X] items of cost costs[X]; one item is served."""
    q = FairQueue(weights, aging_s=1e9)  # no aging: only the shares are measured
    next_id = 0
    now = 0.0
    for _ in range(200):  # a backlog first
        for tenant, rate in rates.items():
            for _ in range(rate):
                next_id += 1
                q.add(next_id, now, costs[tenant], 0, tenant)
    for _ in range(4000):
        now += 0.001
        for tenant, rate in rates.items():
            for _ in range(rate):
                next_id += 1
                q.add(next_id, now, costs[tenant], 0, tenant)
        assert q.pop(now) is not None
    total = sum(q.served.values())
    return {t: q.served.get(t, 0) / total for t in rates}


def test_equal_weights_share_half_each_whatever_the_rates() -> None:
    shares = _served_shares({}, {"heavy": 10, "light": 1}, {"heavy": 1, "light": 1})
    assert shares["heavy"] == pytest.approx(0.5, abs=0.05)
    assert shares["light"] == pytest.approx(0.5, abs=0.05)


def test_share_is_of_cost_not_of_requests() -> None:
    shares = _served_shares({}, {"long": 10, "short": 10}, {"long": 40, "short": 10})
    assert shares["long"] == pytest.approx(0.5, abs=0.05)


def test_weights_three_to_one() -> None:
    shares = _served_shares({"gold": 3, "bronze": 1}, {"gold": 1, "bronze": 10}, {"gold": 1, "bronze": 1})
    assert shares["gold"] == pytest.approx(0.75, abs=0.05)
    assert shares["bronze"] == pytest.approx(0.25, abs=0.05)


def test_an_idle_tenant_banks_no_credit() -> None:
    q = FairQueue()
    for i in range(100):
        q.add(i, 0.0, 1, 0, "busy")
    for _ in range(50):
        q.pop(0.0)
    for i in range(100, 110):  # arrives late: shares from now on, it does not take the next 50 in a row
        q.add(i, 0.0, 1, 0, "late")
    taken = [q.pop(0.0) for _ in range(10)]
    assert sum(1 for i in taken if i is not None and i >= 100) == 5


def test_more_urgent_first_then_oldest() -> None:
    q = FairQueue(aging_s=10.0)
    q.add(1, 0.0, priority=5)
    q.add(2, 0.1, priority=0)
    q.add(3, 0.2, priority=-1)
    q.add(4, 0.3, priority=0)
    assert [q.pop(0.5) for _ in range(4)] == [3, 2, 4, 1]


def test_aging_serves_a_low_priority_item_behind_a_stream_of_urgent_ones() -> None:
    q = FairQueue(aging_s=1.0)
    q.add(0, 0.0, priority=3, tenant="batch")
    now, next_id, served_at = 0.0, 1, None
    while served_at is None and now < 100.0:
        q.add(next_id, now, priority=0, tenant="app")  # the stream never stops, one urgent item per pop
        next_id += 1
        if q.pop(now) == 0:
            served_at = now
        now += 0.01
    assert served_at is not None and 3.0 <= served_at <= 4.1  # about (3 - 0) * aging_s


def test_removed_items_are_skipped() -> None:
    q = FairQueue()
    for i in range(5):
        q.add(i, 0.0)
    assert q.remove(1) and q.remove(3) and not q.remove(3)
    assert [q.pop(0.0) for _ in range(4)] == [0, 2, 4, None]
    assert len(q) == 0


def _scheduler(fair: bool, max_batch_size: int = 2) -> tuple[Scheduler, WorkerPool]:
    pool = WorkerPool(liveness_s=10.0)
    pool.register(b"w", name="w", pid=1, role=ENGINE, models=["m"], credits=1, now=0.0)
    s = Scheduler({"m": BatchPolicy(max_batch_size, 1000.0, 100)}, pool, fair_models=frozenset({"m"} if fair else ()))
    return s, pool


def test_scheduler_takes_urgent_items_first_and_fifo_without_priorities() -> None:
    s, pool = _scheduler(fair=False)
    s.submit("m", 1, 0.0)
    [first] = s.pop_batches(0.0)  # the idle worker takes item 1; the rest queues behind it
    for i, priority in [(2, 0), (3, 0), (4, 0), (5, -1)]:
        s.submit("m", i, 0.1, priority=priority)
    assert "m" in s.fair  # the first priority gave the model a fair queue
    pool.finish(first.batch_id)
    [batch] = s.pop_batches(0.2)
    assert batch.item_ids == [5, 2]
    assert s.depth("m") == 2


def test_scheduler_fifo_path_unchanged() -> None:
    s, _ = _scheduler(fair=False)
    for i in range(1, 4):
        s.submit("m", i, 0.0)
    assert s.fair == {}
    assert [d.item_ids for d in s.pop_batches(0.0)] == [[1, 2]]


def test_scheduler_requeued_item_goes_first_and_removed_items_leave_the_fair_queue() -> None:
    s, _ = _scheduler(fair=True, max_batch_size=4)
    s.submit("m", 1, 0.0, priority=1)
    s.submit("m", 2, 0.0, priority=0)
    s.submit("m", 3, 0.0, priority=0)
    assert s.remove("m", 3)
    s.requeue("m", 9, 0.0)
    [batch] = s.pop_batches(0.0)
    assert batch.item_ids == [9, 2, 1]
    assert s.depth("m") == 0 and len(s.fair["m"]) == 0

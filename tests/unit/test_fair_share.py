"""Priorities with aging and weighted fair share (zserve.batching.fair_share), and the scheduler's use of them, on a
fake clock."""

from __future__ import annotations

import pytest

from zserve.batching.fair_share import FairQueue
from zserve.batching.scheduler import Admission, BatchPolicy, Scheduler
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


def _full(capacity: int, held: dict[str, int], weights: dict[str, float] | None = None) -> FairQueue:
    """A fair queue holding ``held[tenant]`` items per tenant, ids in arrival order (one every ms)."""
    q = FairQueue(weights)
    item_id = 0
    for tenant, n in held.items():
        for _ in range(n):
            item_id += 1
            q.add(item_id, item_id / 1000.0, 1, 0, tenant)
    assert len(q) == capacity
    return q


def test_a_full_queue_makes_room_for_a_tenant_below_its_share_from_the_fattest_tenants_newest() -> None:
    q = _full(10, {"heavy": 7, "mid": 3})
    assert q.push_out("light", 10) == 7  # light holds 0 < 10/3: heavy (7 > 10/3) loses its newest
    assert 7 not in q and len(q) == 9
    assert _full(10, {"heavy": 7, "mid": 3}).push_out("mid", 10) == 7  # mid holds 3 < 10/2
    assert _full(10, {"heavy": 7, "mid": 3}).push_out("heavy", 10) is None  # past its share: the arrival is refused
    assert _full(10, {"a": 5, "b": 5}).push_out("b", 10) is None  # b holds exactly its share
    assert _full(10, {"a": 5, "b": 5}).push_out("c", 10) in (5, 10)  # a new tenant: both past 10/3


def test_a_full_queue_weighs_the_shares() -> None:
    # gold (weight 3) may hold 3/4 of the queue: with 6 of 10 it is below, and bronze (4 > 10/4) makes room
    assert _full(10, {"bronze": 4, "gold": 6}, {"gold": 3}).push_out("gold", 10) == 4
    # bronze with 3 of 10 is past its quarter: refused, whoever holds the rest
    assert _full(10, {"gold": 7, "bronze": 3}, {"gold": 3}).push_out("bronze", 10) is None
    # the fattest per unit of weight: x holds 4 (weight 1), y 5 (weight 2); a newcomer takes x's newest
    assert _full(9, {"x": 4, "y": 5}, {"y": 2}).push_out("new", 9) == 4


def test_the_pushed_out_item_is_the_one_its_tenant_would_serve_last_and_the_rest_keep_their_order() -> None:
    q = FairQueue(aging_s=1.0)
    q.add(1, 0.0, priority=5, tenant="heavy")  # the oldest but least urgent: served last within heavy
    q.add(2, 0.1, tenant="heavy")
    q.add(3, 0.2, tenant="heavy")
    assert q.push_out("light", 3) == 1
    q.add(4, 0.3, priority=-5, tenant="heavy")  # the newest but most urgent
    q.remove(3)  # cancelled: its entry, the heap's largest, stays in the heap until it is met
    q.add(5, 0.4, tenant="light")
    assert q.push_out("other", 3) == 2  # 3's dead entry is skipped (and dropped)
    q.add(6, 0.5, priority=9, tenant="heavy")  # added after the first push-out: kept in the order backwards too
    q.add(7, 0.6, tenant="heavy")
    assert q.push_out("other", 4) == 6
    assert [q.pop(0.7) for _ in range(4)] == [4, 5, 7, None]


def test_requeued_items_take_room_but_are_never_pushed_out() -> None:
    q = FairQueue()
    q.add_front(1, 1, "heavy")  # its batch was lost: admitted and dispatched once
    q.add_front(2, 1, "heavy")
    q.add(3, 0.0, 1, 0, "heavy")
    q.add(4, 0.0, 1, 0, "other")
    assert q.push_out("light", 4) == 3  # heavy holds 3 of 4 (> 4/3): its newest queued one, not 1 or 2
    q.remove(3)
    q.add_front(5, 1, "heavy")
    assert q.push_out("light", 4) is None  # heavy holds only requeued items; other is within its share
    q.add_front(6, 1, "gone")  # a tenant known only by a requeued item
    assert q.push_out("light", 5) is None


def test_scheduler_makes_room_only_at_max_queue_and_a_single_tenant_changes_nothing() -> None:
    pool = WorkerPool(liveness_s=10.0)
    s = Scheduler({"m": BatchPolicy(2, 1000.0, 4)}, pool)
    for i in range(1, 5):
        assert s.submit("m", i, 0.0) is Admission.ACCEPTED  # no tenant: the FIFO
    assert s.submit("m", 5, 0.0) is Admission.OVERLOADED
    assert s.make_room("m", 5) is None and s.fair == {}  # one tenant (""): the arrival is refused, FIFO kept
    assert s.make_room("m", 6, "t") == 4  # another tenant: "" holds 4 > 4/2, its newest makes room
    assert s.depth("m") == 3 and 4 not in s.fair["m"]
    assert s.submit("m", 6, 0.0, tenant="t") is Admission.ACCEPTED
    s.requeue("m", 9, 0.0, tenant="t")  # past max_queue (a lost batch): one out would make no room
    assert s.make_room("m", 7, "u") is None and s.depth("m") == 5

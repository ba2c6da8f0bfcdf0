"""The batching policy, driven by a fake clock (plain floats: the scheduler has no clock of its own)."""

from __future__ import annotations

from zserve.batching.scheduler import Admission, BatchPolicy, Scheduler
from zserve.batching.workers import WorkerPool


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


# ---- cost-aware batching (max_batch_cost) ----


def make_costed(max_batch_size: int = 8, max_wait_ms: float = 10.0, budget: int = 100, credits: int = 1):
    pool = WorkerPool(liveness_s=1.0)
    pool.register(b"w0", name="w0", pid=0, role="engine", models=["m"], credits=credits, now=0.0)
    return Scheduler({"m": BatchPolicy(max_batch_size, max_wait_ms, 1000, budget)}, pool), pool


def batch_cost(costs: dict[int, int], ids: list[int]) -> int:
    return len(ids) * max(costs[i] for i in ids)


def test_cost_budget_closes_a_batch_and_a_full_budget_is_ready():
    s, pool = make_costed(max_batch_size=8, budget=100)
    costs = {i: 20 for i in range(10)}
    for i, c in costs.items():
        assert s.submit("m", i, 0.0, c) is Admission.ACCEPTED
    [d] = s.pop_batches(0.0)
    assert d.item_ids == [0, 1, 2, 3, 4]  # 5 x 20 = 100: a sixth would pass the budget
    pool.finish(d.batch_id)
    [d] = s.pop_batches(0.0)  # 5 x 20 queued = the budget: full, though the window is open and nothing is idle...
    assert d.item_ids == [5, 6, 7, 8, 9] and s.padding["m"] == [200, 200]


def test_queued_cost_makes_a_batch_ready_before_its_count_or_window():
    s, _pool = make_costed(max_batch_size=8, max_wait_ms=50.0, budget=100, credits=2)
    s.submit("m", 0, 0.0, 5)
    [first] = s.pop_batches(0.0)  # the idle worker takes it; it stays busy with one credit left
    s.submit("m", 1, 0.001, 60)
    assert s.pop_batches(0.002) == []  # 60 < 100, 1 < 8 items, window open, worker busy
    s.submit("m", 2, 0.003, 50)
    [d] = s.pop_batches(0.003)  # 110 queued >= 100: ready; but 2 x 60 > 100, so item 2 waits
    assert d.item_ids == [1] and s.depth("m") == 1
    assert first.item_ids == [0]


def test_similar_costs_share_a_batch_within_the_window():
    s, _ = make_costed(max_batch_size=4, max_wait_ms=10.0, budget=10_000)
    costs = {0: 10, 1: 300, 2: 12, 3: 280, 4: 11, 5: 310, 6: 9, 7: 290}
    for i, c in costs.items():
        s.submit("m", i, 0.001 * i, c)
    [d] = s.pop_batches(0.02)
    assert sorted(d.item_ids) == [0, 2, 4, 6]  # the oldest (short) with the other short ones
    real, computed = s.padding["m"]
    assert real / computed >= 0.5


def test_a_long_item_never_pads_a_batch_of_short_ones_below_half_efficiency():
    s, _pool = make_costed(max_batch_size=8, max_wait_ms=10.0, budget=10_000)
    costs = {0: 400, 1: 20, 2: 20, 3: 20, 4: 390}
    for i, c in costs.items():
        s.submit("m", i, 0.0, c)
    [d] = s.pop_batches(0.0)
    # the long ones, then short ones while at least half of what the batch computes is real
    assert sorted(d.item_ids) == [0, 1, 2, 4] and s.depth("m") == 1
    assert sum(costs[i] for i in d.item_ids) >= 0.5 * batch_cost(costs, d.item_ids)


def test_no_item_is_passed_over_by_one_that_arrived_more_than_max_wait_after_it():
    """Fairness bound: only items that arrived within max_wait_ms of the oldest may join its batch, and the
    oldest is always taken, so a long item waits at most until it is the oldest."""
    s, pool = make_costed(max_batch_size=4, max_wait_ms=10.0, budget=10_000)
    s.submit("m", 0, 0.000, 10)
    s.submit("m", 1, 0.000, 10)
    s.submit("m", 2, 0.001, 500)  # long, behind two short ones
    for i in range(3, 13):
        s.submit("m", i, 0.020 + 0.001 * i, 10)  # short ones, arriving more than 10 ms after all three
    [d] = s.pop_batches(0.05)
    assert d.item_ids == [0, 1]  # item 2 is in the window but would pad them; the later short ones are not in it
    pool.finish(d.batch_id)
    [d] = s.pop_batches(0.05)
    # the long one is the oldest now: it goes next, before 10 newer short ones (one of which may join it in
    # arrival order, as 510 of the 1,000 computed is real)
    assert d.item_ids == [2, 3]


def test_past_the_window_items_join_in_arrival_order_while_none_is_skipped():
    s, pool = make_costed(max_batch_size=8, max_wait_ms=5.0, budget=10_000)
    for i in range(6):
        s.submit("m", i, 0.01 * i, 10)  # each more than max_wait_ms after the one before: a queue grown over time
    s.submit("m", 6, 0.06, 500)  # a long one ends the run: joining would pad the batch below half efficiency
    s.submit("m", 7, 0.07, 10)
    [d] = s.pop_batches(0.1)
    assert d.item_ids == [0, 1, 2, 3, 4, 5]  # not item 7: it would pass over item 6
    pool.finish(d.batch_id)
    [d] = s.pop_batches(0.1)
    assert d.item_ids == [6, 7]  # 510 of 1,000 computed is real: at least half


def test_cost_requeue_and_remove_keep_the_queued_cost():
    s, pool = make_costed(max_batch_size=8, budget=100)
    s.submit("m", 0, 0.0, 40)
    s.submit("m", 1, 0.0, 40)
    assert s.remove("m", 1) and not s.remove("m", 1)
    [d] = s.pop_batches(0.0)
    pool.remove(b"w0")
    s.requeue("m", 0, 0.0, 40)
    s.submit("m", 2, 0.0, 70)
    pool.register(b"w0", name="w0", pid=0, role="engine", models=["m"], credits=1, now=0.0)
    [d] = s.pop_batches(0.0)  # 40 + 70 queued >= 100: full; 2 x 70 > 100: the requeued item goes alone
    assert d.item_ids == [0] and s.depth("m") == 1


def test_count_only_models_ignore_costs():
    s, _ = make(max_batch_size=4)
    for i in range(4):
        s.submit("m", i, 0.0, 1_000_000)
    [d] = s.pop_batches(0.0)
    assert d.item_ids == [0, 1, 2, 3] and s.padding == {}

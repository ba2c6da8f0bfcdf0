"""A full queue (``max_queue``) shared by tenants, on the broker core with a fake clock (issue 37): a tenant that
floods a model fills only its weighted share of the queue; the others' arrivals push its newest queued request out
(one OVERLOADED answer), never a dispatched one; a single tenant sees the full queue refuse arrivals as before."""

from __future__ import annotations

import pytest

from bench.faults.qos_flood import flood
from tests.unit.test_broker_core import batches, hello, replies, result
from zserve.broker.core import BrokerCore
from zserve.config import parse_config
from zserve.protocol import Status, Submit, Submits

CONFIG = """
[[models]]
name = "m"
handler = "x:Y"
max_batch_size = 2
max_wait_ms = 10
max_queue = 4
timeout_ms = 60000

[[tenants]]
name = "heavy"
[[tenants]]
name = "light"
"""


def send(core: BrokerCore, client: bytes, req_ids: list[int], now: float = 0.0, **kw) -> None:
    items = [Submit(r, "m", **kw) for r in req_ids]
    core.on_client(client, Submits(items, [1] * len(items)), [b"p"] * len(items), now)


def test_an_open_loop_flood_of_ten_times_the_rate_leaves_each_tenant_half() -> None:
    r = flood({"heavy": 1000, "light": 100}, seconds=5.0)  # engine 200/s, max_queue 100: full all along
    shares = {t: c["share"] for t, c in r["tenants"].items()}
    assert shares["heavy"] == pytest.approx(0.5, abs=0.05) and shares["light"] == pytest.approx(0.5, abs=0.05)
    assert r["tenants"]["heavy"]["pushed_out"] > 0 and r["pending_at_end"] == 100  # the queue was full
    before = flood({"heavy": 1000, "light": 100}, seconds=5.0, make_room=False)["tenants"]["light"]["share"]
    assert before < 0.2  # the rule is what makes the difference (9.5% without it in 20 s)


def test_both_tenants_past_their_share_weights_three_to_one_and_requests_without_a_tenant() -> None:
    r = flood({"heavy": 2000, "light": 200}, seconds=5.0, weights={"light": 3})
    assert r["tenants"]["light"]["share"] == pytest.approx(0.75, abs=0.05)
    r = flood({"heavy": 1000, "": 100}, seconds=5.0)  # no tenant: one tenant of weight 1
    assert r["tenants"][""]["share"] == pytest.approx(0.5, abs=0.05)


def test_a_single_tenant_floods_exactly_as_before() -> None:
    for tenants in ({"only": 1000}, {"": 1000}):
        assert flood(tenants, seconds=2.0) == flood(tenants, seconds=2.0, make_room=False)


def test_the_pushed_out_request_gets_one_overloaded_answer_and_dispatched_ones_are_never_pushed_out() -> None:
    core = BrokerCore(parse_config(CONFIG), epoch=1)
    hello(core, b"w", credits=1)
    send(core, b"h", [1, 2], tenant="heavy")
    core.tick(0.0)  # 1 and 2 go to the idle engine
    send(core, b"h", [3, 4, 5, 6], tenant="heavy")  # and fill the queue
    clients, work = core.flush()
    assert replies(clients, b"h") == []
    [in_flight] = batches(work)
    send(core, b"h", [7], 0.001, tenant="heavy")  # heavy holds all 4: refused, as before
    send(core, b"l", [1], 0.001, tenant="light")  # light holds 0 < 4/2: heavy's newest queued (6) makes room
    send(core, b"l", [2], 0.002, tenant="light")  # again: heavy's 5
    send(core, b"l", [3], 0.003, tenant="light")  # light holds 2 = its share: refused
    clients, _ = core.flush()
    heavy = [(r.req_id, r.status) for r, _ in replies(clients, b"h")]
    assert heavy == [(7, Status.OVERLOADED), (6, Status.OVERLOADED), (5, Status.OVERLOADED)]
    [(refused, _)] = replies(clients, b"l")
    assert (refused.req_id, refused.status) == (3, Status.OVERLOADED)
    pushed = next(r for r, _ in replies(clients, b"h") if r.req_id == 6)
    assert "made room" in pushed.message and "'light'" in pushed.message
    assert core.tenants.counts["heavy"] == [7, 0, 3] and core.tenants.counts["light"] == [3, 0, 1]
    # everything left is served once: the dispatched 1, 2, then the queue (fair share: 3, l1, 4, l2)
    answered: list[tuple[bytes, int]] = []
    now, batch = 0.01, in_flight
    while batch is not None:
        msg, frames = result(batch.header, b"w")
        core.on_out(msg, frames, now)
        core.tick(now)
        clients, work = core.flush()
        answered += [(c, r.req_id) for c in (b"h", b"l") for r, _ in replies(clients, c) if r.status == Status.OK]
        batch = next(iter(batches(work)), None)
        now += 0.01
    assert sorted(answered) == [(b"h", 1), (b"h", 2), (b"h", 3), (b"h", 4), (b"l", 1), (b"l", 2)]
    assert not core.requests


def test_no_request_is_pushed_out_for_an_arrival_that_would_be_refused_as_late() -> None:
    """A light tenant's arrival at a full queue whose wait would pass its deadline is refused, and nothing of the
    heavy tenant's is pushed out for it (found in review: both were answered OVERLOADED, the queue one short)."""
    core = BrokerCore(parse_config(CONFIG), epoch=1)
    hello(core, b"w", credits=1)
    send(core, b"h", [1, 2, 3, 4], tenant="heavy")  # fills max_queue 4 (no tick: nothing dispatched)
    core.flush()
    core.stats["m"].item_s = core.stats["m"].drain_s_per_item = 0.1  # measured: 100 ms an item
    send(core, b"l", [1], 0.001, tenant="light", timeout_ms=250)  # 3 ahead x 0.1 + 0.1 = 0.4 s > 0.25 s
    clients, _ = core.flush()
    assert [(r.req_id, r.status) for r, _ in replies(clients, b"l")] == [(1, Status.OVERLOADED)]
    assert not replies(clients, b"h") and core.scheduler.depth("m") == 4
    send(core, b"l", [2], 0.002, tenant="light", timeout_ms=5000)  # in time: room is made for it
    clients, _ = core.flush()
    assert [(r.req_id, r.status) for r, _ in replies(clients, b"h")] == [(4, Status.OVERLOADED)]
    assert not replies(clients, b"l") and core.scheduler.depth("m") == 4

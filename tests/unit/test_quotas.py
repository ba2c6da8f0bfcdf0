"""Per-tenant quotas (zserve.batching.quotas) and their use by the broker core, on a fake clock: RATE_LIMITED naming
the quota, with when to retry; priorities and tenants through the broker."""

from __future__ import annotations

import pytest

from tests.unit.test_broker_core import batches, hello, replies, result
from zserve.batching.quotas import TenantQuota, TokenBucket
from zserve.broker.core import BrokerCore
from zserve.config import parse_config
from zserve.errors import RateLimited, error_for
from zserve.protocol import Batch, Status, Submit, Submits

CONFIG = """
[broker]
heartbeat_interval_ms = 100
priority_aging_ms = 500

[[models]]
name = "m"
handler = "x:Y"
max_batch_size = 2
max_wait_ms = 10
max_queue = 100
timeout_ms = 60000

[[tenants]]
name = "capped"
requests_per_s = 5

[[tenants]]
name = "tokens"
tokens_per_min = 600

[[tenants]]
name = "two"
max_concurrent = 2

[[tenants]]
name = "free"
weight = 3
"""


def test_bucket_refills_at_its_rate_and_holds_at_most_its_capacity() -> None:
    b = TokenBucket(rate=2.0, capacity=2.0)
    assert b.wait_s(0.0, 1) == 0.0
    b.take(1)
    b.take(1)
    assert b.wait_s(0.0, 1) == pytest.approx(0.5)
    assert b.wait_s(100.0, 1) == 0.0 and b.level == 2.0  # an hour idle banks no more than the capacity


def test_requests_per_s_admits_the_configured_rate() -> None:
    q = TenantQuota(requests_per_s=10)
    admitted = sum(q.admit("t", i * 0.001, 1, 0) is None for i in range(10_000))  # 1000/s for 10 s
    assert admitted == pytest.approx(10 + 10 * 10, rel=0.05)  # a second's burst, then the rate


def test_refusal_names_the_quota_and_when_to_retry() -> None:
    q = TenantQuota(requests_per_s=1, tokens_per_min=60, max_concurrent=3)
    assert q.admit("t", 0.0, 1, 0) is None
    r = q.admit("t", 0.25, 1, 0)
    assert r is not None and r.quota == "requests_per_s" and r.retry_after_s == pytest.approx(0.75)
    assert q.admit("t", 1.0, 1, 3).quota == "max_concurrent"
    assert q.admit("t", 1.0, 100, 0) is None  # more than a minute's tokens: goes when the bucket is full
    r = q.admit("t", 2.0, 100, 0)  # and empties it: the next waits for it to fill again
    assert r is not None and r.quota == "tokens_per_min" and r.retry_after_s == pytest.approx(59.0)


def make() -> BrokerCore:
    return BrokerCore(parse_config(CONFIG), epoch=1, first_batch_id=1)


def send(core: BrokerCore, client: bytes, req_ids: list[int], now: float, **kw) -> None:
    items = [Submit(r, "m", **kw) for r in req_ids]
    core.on_client(client, Submits(items, [1] * len(items)), [b"p"] * len(items), now)


def test_broker_answers_rate_limited_past_requests_per_s() -> None:
    core = make()
    send(core, b"c", list(range(1, 9)), 0.0, tenant="capped")
    send(core, b"c", [100], 0.0, tenant="free")
    clients, _ = core.flush()
    refused = [r for r, _ in replies(clients, b"c")]
    assert len(refused) == 3 and {r.status for r in refused} == {Status.RATE_LIMITED}
    assert {r.field for r in refused} == {"requests_per_s"} and all(r.retry_after_ms == 200 for r in refused)
    assert "capped" in refused[0].message
    assert core.tenants.counts == {"capped": [5, 3, 0], "free": [1, 0, 0]}
    err = error_for(Status(refused[0].status), refused[0].message, refused[0].field, refused[0].retry_after_ms)
    assert isinstance(err, RateLimited) and err.http_status == 429 and err.retry_after_s == pytest.approx(0.2)
    send(core, b"c", [50], 0.2, tenant="capped")  # the bucket has refilled one request
    clients, _ = core.flush()
    assert replies(clients, b"c") == []
    report = core.health(1)
    assert [(t.name, t.admitted, t.rate_limited) for t in report.tenants] == [("capped", 6, 3), ("free", 1, 0)]


def test_health_counts_a_tenants_overloaded_requests_and_its_pending_ones() -> None:
    core = make()
    send(core, b"c", list(range(1, 104)), 0.0, tenant="free")  # max_queue 100, no engine yet
    clients, _ = core.flush()
    assert [r.status for r, _ in replies(clients, b"c")] == [Status.OVERLOADED] * 3
    [t] = core.health(1).tenants
    assert (t.name, t.admitted, t.rate_limited, t.overloaded, t.pending) == ("free", 103, 0, 3, 100)


def test_broker_max_concurrent_counts_pending_requests_until_answered() -> None:
    core = make()
    hello(core, b"w", credits=1)
    send(core, b"c", [1, 2, 3], 0.0, tenant="two")
    core.tick(0.0)
    clients, work = core.flush()
    [(refused, _)] = replies(clients, b"c")
    assert refused.req_id == 3 and refused.field == "max_concurrent"
    [batch] = batches(work)
    msg, frames = result(batch.header, b"w")
    core.on_out(msg, frames, 0.01)
    core.flush()
    assert core.requests.pending_by_tenant["two"] == 0
    send(core, b"c", [4, 5], 0.02, tenant="two")
    clients, _ = core.flush()
    assert replies(clients, b"c") == []


def test_broker_tokens_per_min_charges_the_cost() -> None:
    core = make()
    send(core, b"c", [1], 0.0, tenant="tokens", cost=500)
    send(core, b"c", [2], 0.0, tenant="tokens", cost=200)
    clients, _ = core.flush()
    [(refused, _)] = replies(clients, b"c")
    assert refused.req_id == 2 and refused.field == "tokens_per_min"
    assert refused.retry_after_ms == 10_000  # 100 tokens missing at 10 per second


def test_broker_sends_the_urgent_request_first_and_fifo_without_priorities() -> None:
    core = make()
    hello(core, b"w", credits=1)
    send(core, b"c", [1, 2, 3, 4, 5], 0.0)
    core.tick(0.0)  # 1 and 2 go at once; 3, 4, 5 wait
    send(core, b"c", [9], 0.001, priority=-1)
    _, work = core.flush()
    [first] = batches(work)
    assert core.scheduler.fair["m"] is not None
    msg, frames = result(first.header, b"w")
    core.on_out(msg, frames, 0.002)
    core.tick(0.002)
    _, work = core.flush()
    [second] = batches(work)
    ids = second.header.item_ids
    assert isinstance(second.header, Batch) and [core.requests.get(i).req_id for i in ids] == [9, 3]


def test_tenants_config_is_checked() -> None:
    with pytest.raises(Exception, match="tenant names must be unique"):
        parse_config(CONFIG + '\n[[tenants]]\nname = "free"\n')
    with pytest.raises(Exception, match="weight"):
        parse_config(CONFIG.replace("weight = 3", "weight = 0"))


def test_an_urgent_request_is_not_refused_for_the_queue_it_goes_before() -> None:
    core = make()
    hello(core, b"w", credits=1)
    core.stats["m"].item_s = core.stats["m"].drain_s_per_item = 0.1  # 100 ms per item, one engine
    send(core, b"c", [1, 2, 3, 4, 5, 6], 0.0)
    send(core, b"c", [7], 0.0, timeout_ms=300)  # 6 ahead x 100 ms > 300 ms: refused
    send(core, b"c", [8], 0.0, timeout_ms=300, priority=-1)  # nothing in flight, goes first: admitted
    [(refused, _)] = replies(core.flush()[0], b"c")
    assert refused.req_id == 7 and refused.status == Status.OVERLOADED
    core.tick(0.0)
    [batch] = batches(core.flush()[1])
    assert [core.requests.get(i).req_id for i in batch.header.item_ids] == [8, 1]


def test_a_request_refused_overloaded_after_admission_gets_its_tokens_back() -> None:
    """Tenant "tokens" has 600 tokens a minute; the queue holds 2 (max_queue), so of three requests of 200 tokens
    the third is refused OVERLOADED, and its 200 tokens go back: a fourth of 400 fits the minute's bucket."""
    core = BrokerCore(parse_config(CONFIG.replace("max_queue = 100", "max_queue = 2")), epoch=1, first_batch_id=1)
    send(core, b"c", [1, 2, 3], 0.0, tenant="tokens", cost=200)
    clients, _ = core.flush()
    [(refused, _)] = replies(clients, b"c")
    assert (refused.req_id, refused.status) == (3, Status.OVERLOADED)
    assert core.tenants.quotas["tokens"]._tpm.level == pytest.approx(200)
    hello(core, b"w", credits=2)
    core.tick(0.0)
    send(core, b"c", [4], 0.0, tenant="tokens", cost=200)  # the queue has room again; the bucket holds 200
    clients, _ = core.flush()
    assert replies(clients, b"c") == []


def test_bucket_gives_back_at_most_its_capacity() -> None:
    bucket = TokenBucket(rate=1.0, capacity=10.0)
    assert bucket.wait_s(0.0, 4.0) == 0.0
    bucket.take(4.0)
    bucket.give_back(100.0)  # more than it took: capped at the capacity
    assert bucket.level == 10.0

"""Tenants through a real broker and engine over ipc, driven by the direct client: weighted fair share between a
tenant with a deep backlog and one that arrives later, and the typed RateLimited past a quota."""

from __future__ import annotations

import threading

import pytest

from zserve.errors import RateLimited

CONFIG = """
[broker]
heartbeat_interval_ms = 100

[[models]]
name = "slow"
handler = "testmodels:SlowEcho"
max_batch_size = 1
max_wait_ms = 0
credits = 1
max_queue = 200
timeout_ms = 60000
[models.options]
delay_s = 0.02

[[tenants]]
name = "heavy"

[[tenants]]
name = "light"

[[tenants]]
name = "capped"
requests_per_s = 1
"""


@pytest.fixture
def cluster(cluster_factory):
    c = cluster_factory(CONFIG)
    c.start_broker()
    c.start_engine("slow", 0)
    c.wait_ready({"slow": 1})
    return c


def test_a_tenant_arriving_behind_a_backlog_shares_the_engine_equally(cluster):
    client = cluster.client()
    order: list[str] = []
    lock = threading.Lock()

    def record(name: str):
        def done(_future) -> None:
            with lock:
                order.append(name)

        return done

    heavy = [client.submit("slow", i, tenant="heavy") for i in range(40)]  # 0.8 s of work, queued first
    light = [client.submit("slow", i, tenant="light") for i in range(5)]
    for name, futures in (("heavy", heavy), ("light", light)):
        for f in futures:
            f.add_done_callback(record(name))
    for f in heavy + light:
        f.result(timeout=30)
    # FIFO would answer the light tenant's 5 after all 40; fair share alternates once both wait.
    last_light = max(i for i, name in enumerate(order) if name == "light")
    assert last_light < 16, order


def test_the_client_raises_rate_limited_naming_the_quota(cluster):
    client = cluster.client()
    assert client.predict("slow", 1, tenant="capped")["echo"] == 1
    with pytest.raises(RateLimited) as info:
        client.predict("slow", 2, tenant="capped")
    assert info.value.field == "requests_per_s" and info.value.http_status == 429
    assert 0.0 < info.value.retry_after_s <= 1.0
    assert client.predict("slow", 3, tenant="light")["echo"] == 3  # another tenant is not limited

"""Priorities, tenants and quotas over HTTP, through `zserve up` and gunicorn: a tenant past its requests-per-second
quota gets 429 with Retry-After and a JSON error naming the quota (on the fast path and the falcon route alike), and
an urgent request queued behind many background ones is answered before them."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from deployment import Deployment, free_port, write_config

CAPPED_KEY = "zs-capped-0123456789"
BACKGROUND_KEY = "zs-background-0123456789"
APP_KEY = "zs-app-0123456789"

CONFIG = """
[broker]
heartbeat_interval_ms = 100

[frontends]
workers = 1
port = {port}
api_keys_file = "{keys_file}"

[[models]]
name = "slow"
handler = "testmodels:SlowEcho"
max_batch_size = 1
max_wait_ms = 0
credits = 1
max_queue = 200
timeout_ms = 60000
[models.options]
delay_s = 0.1

[[tenants]]
name = "capped"
requests_per_s = 2

[[tenants]]
name = "background"

[[tenants]]
name = "app"
"""


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    keys_file = tmp / "api_keys"
    keys_file.write_text(
        f"{CAPPED_KEY} tenant=capped\n{BACKGROUND_KEY} tenant=background priority=5\n"
        f"{APP_KEY} tenant=app max_priority=-5\n"
    )
    d = Deployment(write_config(tmp, CONFIG.format(port=free_port(), keys_file=keys_file)))
    yield d.wait_ready()
    assert d.stop() == 0, d.output


def _headers(key: str, priority: int | None = None) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    if priority is not None:
        headers["X-Zserve-Priority"] = str(priority)
    return headers


def _metric(d: Deployment, name: str, labels: str) -> float:
    status, _, text = d.request("GET", "/metrics", None, _headers(APP_KEY))
    assert status == 200
    match = re.search(rf"^{name}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def _queue_depth(d: Deployment) -> float:
    return _metric(d, "zserve_queue_depth", 'model="slow"')


@pytest.mark.parametrize("priority", [None, 0], ids=["fast-path", "falcon-route"])
def test_a_tenant_past_its_rate_gets_429_naming_the_quota(deployment, priority):
    d = deployment
    time.sleep(1.0)  # the bucket (2 requests per second) is full again after the other case
    with ThreadPoolExecutor(8) as pool:
        answers = list(
            pool.map(
                lambda i: d.request("POST", "/v1/models/slow/predict", {"i": i}, _headers(CAPPED_KEY, priority)),
                range(8),
            )
        )
    ok = [a for a in answers if a[0] == 200]
    refused = [a for a in answers if a[0] == 429]
    assert len(ok) + len(refused) == 8, [a[0] for a in answers]
    assert 2 <= len(ok) <= 3 and len(refused) >= 5  # a second's burst (2), perhaps one refilled meanwhile
    for _, headers, body in refused:
        assert int(headers["retry-after"]) >= 1
        error = body["error"]
        assert error["type"] == "rate_limited" and error["field"] == "requests_per_s"
        assert "capped" in error["message"]
    status, _, _ = d.request("POST", "/v1/models/slow/predict", {"i": -1}, _headers(APP_KEY))
    assert status == 200  # other tenants are not limited
    deadline = time.monotonic() + 10  # /metrics reads the broker's report, cached for a moment
    while _metric(d, "zserve_tenant_rate_limited_total", 'tenant="capped"') < len(refused):
        assert time.monotonic() < deadline, "the 429s are not counted in /metrics"
        time.sleep(0.2)
    assert _metric(d, "zserve_tenant_admitted_total", 'tenant="capped"') >= len(ok)


def test_an_urgent_request_is_answered_before_the_background_queued_ahead(deployment):
    d = deployment
    done: list[str] = []
    lock = threading.Lock()

    def call(name: str, key: str, priority: int | None) -> int:
        status, _, _ = d.request("POST", "/v1/models/slow/predict", {"who": name}, _headers(key, priority))
        with lock:
            done.append(name)
        return status

    with ThreadPoolExecutor(32) as pool:
        background = [pool.submit(call, f"bg{i}", BACKGROUND_KEY, None) for i in range(24)]  # the key's priority 5
        deadline = time.monotonic() + 30
        while _queue_depth(d) < 15 and time.monotonic() < deadline:  # queued in the broker (0.1 s per request)
            time.sleep(0.02)
        assert _queue_depth(d) >= 15
        urgent = pool.submit(call, "urgent", APP_KEY, -1)
        assert urgent.result(timeout=30) == 200
        with lock:
            before = [n for n in done if n != "urgent"]
        assert all(f.result(timeout=60) == 200 for f in background)
    # Only what was computing or already next when it arrived goes before it (one at a time, 0.1 s each).
    assert len(before) <= 3, before
    assert done.index("urgent") < len(done) - 10


def test_a_key_asking_more_urgent_than_its_line_allows_gets_403(deployment):
    status, _, body = deployment.request("POST", "/v1/models/slow/predict", {"i": 1}, _headers(BACKGROUND_KEY, 0))
    assert status == 403, body
    assert body["error"]["type"] == "permission_denied" and body["error"]["field"] == "X-Zserve-Priority"

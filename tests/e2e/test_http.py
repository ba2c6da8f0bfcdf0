"""`zserve up` + HTTP through gunicorn: the whole data plane as users run it."""

from __future__ import annotations

import concurrent.futures
import re
import socket
import threading
import time

import psutil
import pytest
from deployment import Deployment, alive, free_port, write_config

CONFIG = """
[broker]
heartbeat_interval_ms = 100

[frontends]
workers = 2
port = {port}
max_body_bytes = 4096

[[models]]
name = "slow"
handler = "testmodels:SlowEcho"
max_batch_size = 16
max_wait_ms = 5
credits = 1
[models.options]
delay_s = 0.03

[[models]]
name = "picky"
handler = "testmodels:Picky"

[[models]]
name = "recorded"
handler = "testmodels:Recorder"
max_batch_size = 1
credits = 1
[models.options]
delay_s = 3.0
log_path = "{log_path}"

[[models]]
name = "narrow"
handler = "testmodels:SlowEcho"
max_batch_size = 1
max_queue = 2
timeout_ms = 250
credits = 1
[models.options]
delay_s = 0.4
"""


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """SIGTERM must stop all of it, gunicorn's workers included."""
    tmp = tmp_path_factory.mktemp("e2e")
    path = write_config(tmp, CONFIG.format(port=free_port(), log_path=tmp / "computed.txt"))
    d = Deployment(path).wait_ready()
    servers = [p for p in psutil.Process(d.proc.pid).children() if p.cmdline()[1:3] == ["-m", "gunicorn"]]
    # Ready means one worker answers /readyz; the second may still be booting (it was, once, in CI).
    deadline = time.monotonic() + 30
    while len(servers) == 1 and len(servers[0].children()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    if len(servers) != 1 or len(servers[0].children()) != 2:  # the server's master and its 2 workers
        workers = servers[0].children() if len(servers) == 1 else []
        d.stop()
        raise AssertionError(f"expected one gunicorn master with 2 workers: {servers}, {workers}\n{d.output}")
    yield d
    everything = d.descendants()
    assert d.stop() == 0, d.output
    assert alive(everything) == []


def test_predict_health_and_model_list(deployment):
    status, headers, body = deployment.request("POST", "/v1/models/slow/predict", {"x": [1, "two"]})
    assert status == 200, body
    assert body["echo"] == {"x": [1, "two"]}
    assert headers["x-zserve-batch-size"] == "1"
    assert float(headers["x-zserve-queue-ms"]) >= 0
    assert deployment.request("GET", "/healthz")[0] == 200
    status, _, ready = deployment.request("GET", "/readyz")
    assert status == 200 and ready["engines"] == {"slow": 1, "picky": 1, "recorded": 1, "narrow": 1}
    status, _, models = deployment.request("GET", "/v1/models")
    assert [m["id"] for m in models["data"]] == ["slow", "picky", "recorded", "narrow"]


def test_batching_under_64_concurrent_clients_shows_in_headers_and_metrics(deployment):
    def one(i):
        return deployment.request("POST", "/v1/models/slow/predict", {"i": i})

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(256)))
    assert all(status == 200 for status, _, _ in results)
    assert [body["echo"]["i"] for _, _, body in results] == list(range(256))
    sizes = [int(headers["x-zserve-batch-size"]) for _, headers, _ in results]
    assert max(sizes) > 1
    _, _, metrics = deployment.request("GET", "/metrics")
    count = float(re.search(r'zserve_batch_size_count\{model="slow"\} (\S+)', metrics).group(1))
    total = float(re.search(r'zserve_batch_size_sum\{model="slow"\} (\S+)', metrics).group(1))
    assert count >= 256 and total / count > 1.5  # aggregated over both gunicorn workers
    assert re.search(r'zserve_requests_total\{code="200",model="slow"\} (\S+)', metrics)
    assert "zserve_request_latency_seconds_bucket" in metrics
    assert re.search(r'zserve_queue_depth\{model="slow"\} 0\.0', metrics)


@pytest.mark.parametrize(
    ("path", "body", "status", "error_type", "field"),
    [
        ("/v1/models/picky/predict", b"{not json", 400, "bad_request", "body"),
        ("/v1/models/picky/predict", {"reject": 1}, 400, "bad_request", "reject"),
        ("/v1/models/nope/predict", {"x": 1}, 404, "unknown_model", None),
        ("/v1/models/picky/predict", {"x": "y" * 5000}, 413, "payload_too_large", None),
        ("/v1/models/picky/predict", '"boom"', 500, "model_error", None),
        ("/nowhere", None, 404, "not_found", None),
    ],
)
def test_bad_inputs_get_json_errors(deployment, path, body, status, error_type, field):
    got, _, payload = deployment.request("POST" if body is not None else "GET", path, body)
    assert got == status, payload
    assert payload["error"]["type"] == error_type
    assert payload["error"]["message"]
    assert payload["error"].get("field") == field


def test_overload_is_503_with_retry_after_and_deadline_is_504(deployment):
    def one(i):
        return deployment.request("POST", "/v1/models/narrow/predict", {"i": i})

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    statuses = sorted(status for status, _, _ in results)
    assert 503 in statuses and 504 in statuses, statuses
    for status, headers, body in results:
        if status == 503:
            assert headers["retry-after"] == "1" and body["error"]["type"] == "overloaded"
        if status == 504:
            assert body["error"]["type"] == "deadline_exceeded"


def _gauge(deployment, name, model):
    _, _, metrics = deployment.request("GET", "/metrics")
    match = re.search(rf'{name}\{{model="{model}"\}} (\S+)', metrics)
    return float(match.group(1)) if match else None


def _wait_gauge(deployment, name, model, value):
    deadline = time.monotonic() + 10
    while _gauge(deployment, name, model) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.05)


def test_a_client_that_disconnects_cancels_its_request(deployment):
    computed = deployment.config_path.parent / "computed.txt"
    busy = threading.Thread(target=deployment.request, args=("POST", "/v1/models/recorded/predict", '"first"'))
    busy.start()
    _wait_gauge(deployment, "zserve_in_flight", "recorded", 1.0)  # "first" holds the only engine for 3 s
    host, port = deployment.url.removeprefix("http://").rsplit(":", 1)
    body = b'"abandoned"'
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/models/recorded/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        _wait_gauge(deployment, "zserve_queue_depth", "recorded", 1.0)  # "abandoned" waits in the broker
    _wait_gauge(deployment, "zserve_queue_depth", "recorded", 0.0)  # the hang-up removed it at once
    assert _gauge(deployment, "zserve_in_flight", "recorded") == 1.0  # while "first" still runs
    busy.join()
    status, _, out = deployment.request("POST", "/v1/models/recorded/predict", '"last"')
    assert status == 200 and out["echo"] == "last"
    assert computed.read_text().split() == ["first", "last"]  # "abandoned" was never computed

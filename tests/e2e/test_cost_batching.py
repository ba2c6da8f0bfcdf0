"""Cost-aware batching through a real deployment: the frontends compute each item's cost with the
handler's ``cost`` and the broker keeps every batch within ``max_batch_cost``; the direct client passes
``cost=`` itself. A handler without ``cost`` is refused at start."""

from __future__ import annotations

import concurrent.futures
import re
import subprocess
import sys

from cluster import subprocess_env
from deployment import Deployment, free_port, write_config

from zserve import Client

CONFIG = """
[frontends]
workers = 1
port = {port}

[[models]]
name = "m"
handler = "testmodels:CostedEcho"
options = {{ delay_s = 0.02 }}
max_batch_size = 16
max_wait_ms = 20
max_batch_cost = 100
"""


def test_batches_stay_within_the_cost_budget_over_http_and_the_direct_client(tmp_path):
    path = write_config(tmp_path, CONFIG.format(port=free_port()))
    d = Deployment(path).wait_ready()
    try:
        bodies = [{"cost": 60 if i % 4 == 0 else 10} for i in range(48)]
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda b: d.request("POST", "/v1/models/m/predict", b), bodies))
        assert all(status == 200 for status, _, _ in answers), answers[:3]
        # echo tells each item its batch size: a batch holding a 60 has at most one item (2 x 60 > 100)
        for _status, _, body in answers:
            if body["echo"]["cost"] == 60:
                assert body["batch"] == 1, body
            else:
                assert body["batch"] <= 10, body  # 10 x 10 = the budget
        assert any(body["batch"] > 1 for _, _, body in answers)  # the short ones did share batches
        with Client.from_config(path) as client:
            futures = [client.submit("m", {"n": i}, cost=100, meta=True) for i in range(6)]
            assert [f.result(timeout=60).batch_size for f in futures] == [1] * 6  # each fills the budget
            health = next(m for m in client.health().models if m.name == "m")
        assert 0 < health.batched_cost <= health.padded_cost
        assert health.batched_cost >= 0.5 * health.padded_cost
        _, _, metrics = d.request("GET", "/metrics")  # the same counts for Prometheus (the health cache may lag)
        cost = float(re.search(r'^zserve_batch_cost_total\{model="m"\} (\S+)', metrics, re.M).group(1))
        padded = float(re.search(r'^zserve_batch_padded_cost_total\{model="m"\} (\S+)', metrics, re.M).group(1))
        assert 0 < cost <= padded <= 2 * cost
    finally:
        assert d.stop() == 0, d.output


def test_max_batch_cost_needs_a_handler_that_reports_costs(tmp_path):
    path = write_config(tmp_path, CONFIG.format(port=free_port()).replace("CostedEcho", "SlowEcho"))
    run = subprocess.run([sys.executable, "-m", "zserve.cli", "up", "-c", str(path)], capture_output=True,
                         text=True, timeout=120, env=subprocess_env())  # fmt: skip
    assert run.returncode != 0
    assert "max_batch_cost is set but handler testmodels:SlowEcho has no cost() method" in run.stdout + run.stderr

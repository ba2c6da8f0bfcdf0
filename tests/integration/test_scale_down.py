"""Scale-down without loss (issue 27): a worker sent SIGTERM, as Kubernetes does when it scales a Deployment
down or rolls it, says Leave, finishes what it computes, hands back what it had not started, and exits 0 once
the broker dismisses it. With ``max_redispatch = 0`` a single lost batch would be answered engine_lost, so
"every request answered with its result" shows that nothing was lost, not that it was re-dispatched."""

from __future__ import annotations

import signal
import threading
import time

import pytest
from tinylm import build_tiny_lm

STAGED = """
[broker]
heartbeat_interval_ms = 100
heartbeat_liveness = 5
max_redispatch = 0

[[models]]
name = "slow"
handler = "testmodels:SlowEcho"
engines = 2
max_batch_size = 4
max_wait_ms = 2
credits = 2
[models.options]
delay_s = 0.03

[[models]]
name = "staged"
handler = "testmodels:Staged"
engines = 1
max_batch_size = 4
max_wait_ms = 2
preprocess_workers = 2
[models.options]
stage_delay_s = 0.03
"""


class Load:
    """Closed-loop callers of one model; every answer is kept, every failure too."""

    def __init__(self, client, model: str, callers: int = 4) -> None:
        self.answers: list = []
        self.failures: list[BaseException] = []
        self.stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(client, model, i), daemon=True) for i in range(callers)
        ]
        for t in self._threads:
            t.start()

    def _run(self, client, model: str, caller: int) -> None:
        i = 0
        while not self.stop.is_set():
            futures = [client.submit(model, f"{caller}-{i}-{k}") for k in range(4)]
            i += 1
            for k, f in enumerate(futures):
                try:
                    self.answers.append((f"{caller}-{i - 1}-{k}", f.result(timeout=30)))
                except BaseException as exc:
                    self.failures.append(exc)

    def finish(self) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(timeout=60)

    def wait_for(self, n: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.answers) < n:
            assert time.monotonic() < deadline and not self.failures, self.failures[:3]
            time.sleep(0.02)


def test_engines_and_a_stage_told_to_stop_under_load_lose_nothing(cluster_factory):
    c = cluster_factory(STAGED)
    c.start_broker()
    e0 = c.start_engine("slow", 0)
    c.start_engine("slow", 1)
    c.start_engine("staged", 0)
    s0 = c.start_stage("staged", 0)
    c.start_stage("staged", 1)
    c.wait_ready({"slow": 2, "staged": 1}, stages={"staged": 2})
    client = c.client(timeout_ms=30_000)
    slow, staged = Load(client, "slow"), Load(client, "staged")
    try:
        slow.wait_for(40)
        staged.wait_for(40)
        e0.send_signal(signal.SIGTERM)  # a scale-down: the engine pod is deleted
        s0.send_signal(signal.SIGTERM)
        assert e0.wait(timeout=10) == 0 and s0.wait(timeout=10) == 0
        del c.procs["engine-slow-0"], c.procs["stage-staged-0"]  # gone, as their pods
        before = len(slow.answers), len(staged.answers)
        slow.wait_for(before[0] + 40)  # the survivors serve on
        staged.wait_for(before[1] + 40)
        c.start_engine("slow", 2)  # a scale-up
        c.wait_ready({"slow": 2})
        slow.wait_for(len(slow.answers) + 40)
    finally:
        slow.finish()
        staged.finish()
    assert not slow.failures and not staged.failures, (slow.failures + staged.failures)[:3]
    assert all(a["echo"] == item for item, a in slow.answers)
    assert all(a["echo"] == item for item, a in staged.answers)
    broker = c.log("broker")
    assert "engine-slow-0" in broker and "left" in broker and "stage-staged-0" in broker
    assert "lost" not in broker and "disconnected" not in broker
    assert "leaving" in c.log("engine-slow-0")


GENERATIVE = """
[broker]
heartbeat_interval_ms = 100
heartbeat_liveness = 5
max_redispatch = 0

[[models]]
name = "lm"
handler = "zserve.models.causal_lm:CausalLM"
engines = 2
timeout_ms = 60000
[models.options]
path = "{path}"
block_size = 8
num_blocks = 64
max_new_tokens = 24
"""


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_lm(tmp_path_factory.mktemp("tinylm"))


def test_a_generative_engine_told_to_stop_finishes_its_sequences(cluster_factory, tiny_path):
    c = cluster_factory(GENERATIVE.format(path=tiny_path))
    c.start_broker()
    e0 = c.start_engine("lm", 0)
    c.start_engine("lm", 1)
    c.wait_ready({"lm": 2}, timeout_s=120)
    client = c.client(timeout_ms=60_000)
    futures = [
        client.submit("lm", {"prompt": f"hello {i}", "max_new_tokens": 24, "ignore_eos": True}) for i in range(16)
    ]
    deadline = time.monotonic() + 30
    while client.health().models[0].running_sequences == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    e0.send_signal(signal.SIGTERM)
    answers = [f.result(timeout=60) for f in futures]
    assert e0.wait(timeout=30) == 0
    assert all(a["generated_length"] == 24 for a in answers), answers[:2]
    assert "lost" not in c.log("broker") and "left" in c.log("broker")

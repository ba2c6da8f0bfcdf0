"""Real preprocess stage and engine processes behind a real broker."""

from __future__ import annotations

import signal
import time

import pytest

import zserve

STAGED = """
[broker]
heartbeat_interval_ms = 100
heartbeat_liveness = 5

[[models]]
name = "staged"
handler = "testmodels:Staged"
max_batch_size = 8
max_wait_ms = 5
preprocess_workers = 2
[models.options]
stage_delay_s = {stage_delay}
engine_delay_s = 0.02
"""


def start(cluster_factory, stage_delay=0.02, stages=2):
    c = cluster_factory(STAGED.format(stage_delay=stage_delay))
    c.start_broker()
    c.start_engine("staged", 0)
    procs = [c.start_stage("staged", i) for i in range(stages)]
    c.wait_ready({"staged": 1}, stages={"staged": stages})
    return c, procs


def test_items_flow_through_a_stage_then_an_engine(cluster_factory):
    c, stages = start(cluster_factory)
    client = c.client()
    results = [f.result(timeout=30) for f in [client.submit("staged", i) for i in range(64)]]
    assert [r["echo"] for r in results] == list(range(64))
    assert {r["stage_pid"] for r in results} == {p.pid for p in stages}  # both stages took batches
    assert len({r["engine_pid"] for r in results}) == 1
    assert max(r["batch"] for r in results) > 1
    report = client.health()
    [m] = report.models
    assert m.preprocess_workers == 2 and m.preprocess_busy_s > 0 and m.engine_busy_s > 0


def test_a_preprocess_exception_answers_only_its_batch(cluster_factory):
    c, _ = start(cluster_factory, stages=1)
    client = c.client()
    with pytest.raises(zserve.BadRequest, match="preprocess stage stage-staged-0"):
        client.predict("staged", "poison")
    assert client.predict("staged", "fine")["echo"] == "fine"  # the stage kept serving


def test_a_stage_killed_mid_batch_loses_no_request(cluster_factory):
    c, (s0, s1) = start(cluster_factory, stage_delay=0.4)
    client = c.client()
    futures = [client.submit("staged", i) for i in range(32)]
    time.sleep(0.2)  # both stages hold a batch (0.4 s each)
    s0.send_signal(signal.SIGKILL)
    results = [f.result(timeout=60) for f in futures]
    assert [r["echo"] for r in results] == list(range(32))
    assert {r["stage_pid"] for r in results} == {s1.pid}


def test_a_stage_slow_past_the_deadline_does_not_block_the_others(cluster_factory):
    c, stages = start(cluster_factory)
    client = c.client()
    stuck = client.submit("staged", "slow", timeout_ms=500)  # holds one stage for 2 s
    time.sleep(0.1)
    started = time.monotonic()
    results = [f.result(timeout=30) for f in [client.submit("staged", i) for i in range(40)]]
    assert time.monotonic() - started < 1.5  # served by the other stage meanwhile
    assert [r["echo"] for r in results] == list(range(40))
    [busy_one] = {p.pid for p in stages} - {r["stage_pid"] for r in results}  # never answered meanwhile
    assert busy_one in {p.pid for p in stages}
    with pytest.raises(zserve.DeadlineExceeded):
        stuck.result(timeout=30)


def test_an_item_answered_while_in_a_stage_does_not_fail_its_batch_mates(cluster_factory):
    c, _ = start(cluster_factory, stage_delay=0.5, stages=1)
    client = c.client()
    blocker = client.submit("staged", "first")  # holds the only stage for 0.5 s
    time.sleep(0.05)
    doomed = client.submit("staged", "short-lived", timeout_ms=700)  # batched with the mates; expires in the stage
    mates = [client.submit("staged", i) for i in range(5)]
    assert blocker.result(timeout=30)["echo"] == "first"
    with pytest.raises(zserve.DeadlineExceeded):
        doomed.result(timeout=30)
    results = [f.result(timeout=30) for f in mates]
    assert [r["echo"] for r in results] == list(range(5))
    assert {r["batch"] for r in results} == {6}  # computed in one batch with the expired item

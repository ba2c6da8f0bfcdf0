"""A real broker and real engine processes over ipc, driven by the direct client."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import shutil
import signal
import subprocess
import time

import pytest
import zmq

import zserve
from zserve.protocol import Codec, HealthQuery
from zserve.workers.runtime import EXIT_REPLACED

SLOW = """
[broker]
heartbeat_interval_ms = 100
heartbeat_liveness = 5

[[models]]
name = "slow"
handler = "testmodels:SlowEcho"
engines = 2
max_batch_size = 8
max_wait_ms = 5
credits = 1
[models.options]
delay_s = {delay}
"""


def one_engine(cluster_factory, delay: float):
    """A broker and one SlowEcho engine, ready."""
    c = cluster_factory(SLOW.format(delay=delay))
    c.start_broker()
    c.start_engine("slow", 0)
    c.wait_ready({"slow": 1})
    return c


def test_requests_are_batched_and_each_gets_its_own_answer(cluster_factory):
    c = one_engine(cluster_factory, delay=0.05)
    client = c.client()
    futures = [client.submit("slow", {"i": i}, meta=True) for i in range(64)]
    answers = [f.result(timeout=30) for f in futures]
    assert [a.value["echo"] for a in answers] == [{"i": i} for i in range(64)]
    sizes = [a.batch_size for a in answers]
    assert max(sizes) == 8  # full batches formed while the engine was busy
    assert all(a.value["batch"] == a.batch_size for a in answers)
    assert sum(a.queue_ms for a in answers) > 0


def test_lone_request_is_not_held_for_the_batching_window(cluster_factory):
    c = cluster_factory(SLOW.format(delay=0.0).replace("max_wait_ms = 5", "max_wait_ms = 2000"))
    c.start_broker()
    c.start_engine("slow", 0)
    c.wait_ready({"slow": 1})
    client = c.client()
    for i in range(5):
        answer = client.infer("slow", i)
        assert answer.batch_size == 1
        assert answer.queue_ms < 100  # an idle engine takes it now, not after max_wait_ms = 2000


def test_engine_killed_mid_batch_loses_no_request(cluster_factory):
    c = cluster_factory(SLOW.format(delay=0.3))
    c.start_broker()
    e0 = c.start_engine("slow", 0)
    e1 = c.start_engine("slow", 1)
    c.wait_ready({"slow": 2})
    client = c.client()
    futures = [client.submit("slow", i) for i in range(40)]
    time.sleep(0.15)  # let both engines get a batch (each takes 0.3 s) before the kill
    e0.send_signal(signal.SIGKILL)
    results = [f.result(timeout=60) for f in futures]
    assert [r["echo"] for r in results] == list(range(40))
    assert {r["pid"] for r in results} == {e1.pid}  # e0 never answered: its batch was re-dispatched
    assert "engine-slow-0" in c.log("broker") and ("disconnected" in c.log("broker") or "lost" in c.log("broker"))


def test_a_batch_lost_twice_is_answered_engine_lost(cluster_factory):
    c = cluster_factory(SLOW.format(delay=1.0))
    c.start_broker()
    e0 = c.start_engine("slow", 0)
    c.wait_ready({"slow": 1})
    client = c.client()
    future = client.submit("slow", "x")
    e1 = c.start_engine("slow", 1)
    c.wait_ready({"slow": 2})
    e0.send_signal(signal.SIGKILL)  # holds the batch; it goes to e1
    deadline = time.monotonic() + 10
    while "disconnected" not in c.log("broker") and "was lost" not in c.log("broker") and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    e1.send_signal(signal.SIGKILL)
    with pytest.raises(zserve.EngineLost, match="gave up after 2 attempts"):
        future.result(timeout=30)


def test_overload_deadline_unknown_model_and_bad_input(cluster_factory):
    c = cluster_factory(
        SLOW.format(delay=0.5).replace("engines = 2", "engines = 1\nmax_queue = 4\ntimeout_ms = 300")
        + '\n[[models]]\nname = "picky"\nhandler = "testmodels:Picky"\n'
    )
    c.start_broker()
    c.start_engine("slow", 0)
    c.start_engine("picky", 0)
    c.wait_ready({"slow": 1, "picky": 1})
    client = c.client()
    futures = [client.submit("slow", i) for i in range(20)]
    errors = []
    for f in futures:
        try:
            f.result(timeout=30)
        except zserve.ZserveError as exc:
            errors.append(type(exc))
    assert zserve.Overloaded in errors  # past max_queue: answered at once
    assert zserve.DeadlineExceeded in errors  # queued behind a 0.5 s batch with a 0.3 s deadline
    with pytest.raises(zserve.UnknownModel, match="no model named 'nope'"):
        client.predict("nope", 1)
    with pytest.raises(zserve.BadRequest) as info:
        client.predict("picky", {"reject": True})
    assert info.value.field == "reject"
    with pytest.raises(zserve.ModelError, match="boom"):
        client.predict("picky", "boom")
    assert client.predict("picky", "fine") == {"ok": "fine"}  # the engine kept serving
    with pytest.raises(zserve.DeadlineExceeded):
        client.predict("slow", 1, timeout_ms=50)


def test_async_client_and_many_futures_from_one_thread(cluster_factory):
    c = one_engine(cluster_factory, delay=0.01)

    async def main():
        async with zserve.AsyncClient(c.plan.endpoints.client) as client:
            results = await asyncio.gather(*(client.predict("slow", i) for i in range(100)))
            with pytest.raises(zserve.UnknownModel):
                await client.predict("nope", 1)
            return results

    results = asyncio.run(main())
    assert [r["echo"] for r in results] == list(range(100))
    client = c.client()
    done = concurrent.futures.wait([client.submit("slow", i) for i in range(200)], timeout=30).done
    assert sorted(f.result()["echo"] for f in done) == list(range(200))


def test_malformed_frames_do_not_stop_the_broker(cluster_factory):
    c = one_engine(cluster_factory, delay=0.0)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(c.plan.endpoints.client)
    for junk in ([b"\xc1\xc1"], [b""], [Codec().encode(HealthQuery(1))[:-1]]):
        sock.send_multipart(junk)
    sock.send(Codec().encode(HealthQuery(7)))
    assert sock.poll(5000)
    assert Codec().decode(sock.recv()).query_id == 7
    sock.close(0)
    ctx.term()
    assert c.client().predict("slow", "still here")["echo"] == "still here"
    assert "dropped malformed frame from client" in c.log("broker")


def test_broker_restart_loses_no_accepted_request_and_engines_re_register(cluster_factory):
    c = cluster_factory(SLOW.format(delay=1.0))
    broker = c.start_broker()
    c.start_engine("slow", 0)
    c.wait_ready({"slow": 1})
    client = c.client()
    futures = [client.submit("slow", f"sync {i}") for i in range(12)]

    async def async_requests() -> list:
        async with zserve.AsyncClient(c.plan.endpoints.client) as aclient:
            tasks = [asyncio.create_task(aclient.predict("slow", f"async {i}")) for i in range(12)]
            await asyncio.sleep(0.3)  # in flight in the broker and the engine when it dies
            broker.send_signal(signal.SIGKILL)
            broker.wait()
            c.start_broker()
            return await asyncio.gather(*tasks)

    answers = asyncio.run(async_requests())
    assert [a["echo"] for a in answers] == [f"async {i}" for i in range(12)]  # resubmitted to the new broker
    assert [f.result(timeout=60)["echo"] for f in futures] == [f"sync {i}" for i in range(12)]
    c.wait_ready({"slow": 1}, timeout_s=30)  # the engine noticed and registered again
    assert client.predict("slow", "again")["echo"] == "again"
    assert os.path.exists(c.run_dir)


def test_client_endpoint_may_be_plain_tcp_on_loopback_and_from_config_finds_the_ipc_one(cluster_factory, tmp_path):
    from deployment import free_port

    port = free_port()
    toml = f'[broker]\nclient_endpoint = "tcp://127.0.0.1:{port}"\ninsecure = true\n' + SLOW.format(delay=0.0).replace(
        "[broker]", ""
    )
    c = cluster_factory(toml)
    c.start_broker()
    c.start_engine("slow", 0)
    c.wait_ready({"slow": 1})
    path = tmp_path / "tcp.toml"
    path.write_text(f'[supervisor]\nrun_dir = "{c.run_dir}"\n' + toml)
    with zserve.Client(f"tcp://127.0.0.1:{port}") as client:
        assert client.predict("slow", "over tcp")["echo"] == "over tcp"
    with zserve.Client.from_config(path) as client:  # a process of this host: the ipc endpoint
        assert client.endpoint == f"ipc://{c.run_dir}/client.sock"
        assert client.predict("slow", "over ipc")["echo"] == "over ipc"


def test_generate_on_a_model_that_is_not_generative_is_a_clear_error(cluster_factory):
    client = one_engine(cluster_factory, delay=0.0).client()
    with pytest.raises(zserve.ModelError, match="did not answer like a generative model"):
        client.generate(["hi"], model="slow")


def test_streaming_a_batch_model_is_a_clear_error(cluster_factory):
    c = one_engine(cluster_factory, delay=0.0)
    client = c.client()
    with pytest.raises(zserve.BadRequest, match="not generative"):
        list(client.generate_stream("x", model="slow"))
    assert client.predict("slow", {"still": "served"})["echo"] == {"still": "served"}


HANGS = """
[broker]
heartbeat_interval_ms = 100

[[models]]
name = "hangs"
handler = "testmodels:Hangs"
engines = 3
max_batch_size = 1
credits = 1
batch_timeout_s = 1.0
[models.options]
delay_s = 0.02
"""


def test_a_hung_engine_is_found_killed_and_its_batch_redispatched_once(cluster_factory):
    c = cluster_factory(HANGS)
    c.start_broker()
    engines = [c.start_engine("hangs", i) for i in range(3)]
    c.wait_ready({"hangs": 3})
    client = c.client()
    hung = client.submit("hangs", "hang")
    time.sleep(0.1)  # "hang" reaches an engine first
    normal = [client.submit("hangs", i) for i in range(30)]
    with pytest.raises(zserve.EngineLost, match="hung; gave up after 2 attempts"):
        hung.result(timeout=30)  # its engine, then the one it was re-dispatched to, both hung
    assert [f.result(timeout=30)["echo"] for f in normal] == list(range(30))  # nothing waits behind them
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and sum(e.poll() is not None for e in engines) < 2:
        time.sleep(0.05)
    killed = [e for e in engines if e.poll() is not None]
    # told to exit (Replace) and SIGKILLed by the broker's host at once: whichever came first
    assert len(killed) == 2 and all(e.returncode in (-signal.SIGKILL, EXIT_REPLACED) for e in killed)
    report = client.health()
    [m] = report.models
    assert m.workers_hung == 2 and m.ready_workers == 1
    assert "is hung: no progress" in c.log("broker")


def test_a_hung_worker_the_broker_cannot_kill_exits_when_told_to(cluster_factory):
    """A worker in its own PID namespace stands for one on another host: the pid it registers with is not a
    process the broker's host can signal, so only the Replace message can make it exit (and its own
    supervisor restart it)."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "--pid", "--fork", "true"]).returncode:
        pytest.skip("unshare --pid is not available here (needs CAP_SYS_ADMIN)")
    c = cluster_factory(HANGS.replace("engines = 3", "engines = 1"))
    c.start_broker()
    child = c.plan.engine(c.config.model("hangs"), 0)
    engine = c._spawn(dataclasses.replace(child, argv=("unshare", "--pid", "--fork", "--kill-child", *child.argv)))
    c.wait_ready({"hangs": 1})
    client = c.client()
    hung = client.submit("hangs", "hang", timeout_ms=4000)
    assert engine.wait(timeout=20) == EXIT_REPLACED  # unshare exits with its child's status
    assert "is not a process of this host: it was told to exit (Replace)" in c.log("broker")
    assert "found this worker hung" in c.log("engine-hangs-0")
    with pytest.raises(zserve.DeadlineExceeded):  # queued again as a suspect, and no engine left to take it
        hung.result(timeout=30)

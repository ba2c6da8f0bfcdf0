"""Two hosts on one machine: a network namespace joined to the default one by a veth pair. The broker and a
local engine run here, a worker host (`zserve workers`) in the namespace over CURVE tcp. Under load the link
is cut: every request is still answered (re-dispatched to the local engine); when it comes back the remote
engine registers again by itself and serves again."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest
from multihost import WorkerHostProc, broker_toml, make_keys, workers_toml

from zserve.transport import free_tcp_port

MODEL = """
[[models]]
name = "echo"
handler = "testmodels:SlowEcho"
engines = 1
max_batch_size = 4
max_wait_ms = 1
credits = 1
[models.options]
delay_s = 0.01
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def netns():
    """(namespace, our veth, our address, its address); removed afterwards. Skips where the kernel refuses."""
    tag = os.getpid() % 100_000
    ns, ours, theirs = f"zs-{tag}", f"zsa{tag}", f"zsb{tag}"
    subnet = f"10.213.{tag % 250}"
    steps = [
        ("netns", "add", ns),
        ("link", "add", ours, "type", "veth", "peer", "name", theirs),
        ("link", "set", theirs, "netns", ns),
        ("addr", "add", f"{subnet}.1/24", "dev", ours),
        ("link", "set", ours, "up"),
        ("-n", ns, "addr", "add", f"{subnet}.2/24", "dev", theirs),
        ("-n", ns, "link", "set", theirs, "up"),
        ("-n", ns, "link", "set", "lo", "up"),
    ]
    try:
        for step in steps:
            _ip(*step)
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        subprocess.run(["ip", "link", "del", ours], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        reason = exc.stderr.strip() if isinstance(exc, subprocess.CalledProcessError) else str(exc)
        pytest.skip(f"cannot create a network namespace and veth pair here (root and CAP_NET_ADMIN needed): {reason}")
    try:
        yield ns, ours, f"{subnet}.1"
    finally:
        subprocess.run(["ip", "link", "del", ours], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_worker_host_in_another_namespace_loses_its_link_under_load_and_rejoins(netns, cluster_factory, tmp_path):
    ns, veth, address = netns
    keys = tmp_path / "keys"
    make_keys(keys, "broker", "hostb", authorized=("hostb",))
    ports = tuple(free_tcp_port(address) for _ in range(3))
    c = cluster_factory(broker_toml(address, ports, keys) + MODEL)
    c.start_broker()
    local = c.start_engine("echo", 0).pid
    config = tmp_path / "workers.toml"
    config.write_text(workers_toml(address, ports, keys, "hostb", tmp_path / "run-b", MODEL))
    host = WorkerHostProc(config, tmp_path / "workers.log", netns=ns)
    try:
        c.wait_ready({"echo": 2})
        client = c.client(timeout_ms=30_000)
        served: dict[int, int] = {}
        failures: list[BaseException] = []
        sent = [0]
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                futures = [client.submit("echo", i) for i in range(8)]
                sent[0] += len(futures)
                for f in futures:
                    try:
                        pid = f.result(timeout=60)["pid"]
                        served[pid] = served.get(pid, 0) + 1
                    except BaseException as exc:  # every request must be answered with a result
                        failures.append(exc)

        def remote_count() -> int:
            return sum(n for pid, n in served.items() if pid != local)

        threads = [threading.Thread(target=load, daemon=True) for _ in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while remote_count() < 20:
            assert time.monotonic() < deadline, f"the remote engine served nothing: {served}\n{host.output()}"
            time.sleep(0.05)

        _ip("link", "set", veth, "down")  # the network between the hosts is gone
        cut_at = time.monotonic()
        deadline = time.monotonic() + 30
        while c.client().health().models[0].ready_workers != 1:
            assert time.monotonic() < deadline, "the broker never declared the remote engine lost"
            time.sleep(0.05)
        cut_remote, cut_local = remote_count(), served.get(local, 0)
        deadline = time.monotonic() + 30
        # Load goes on, on the local engine only; the cut outlasts the ZMTP ping timeout (2 s), so the tcp
        # connections are dropped and redialled, as after a real outage.
        while served.get(local, 0) < cut_local + 50 or time.monotonic() - cut_at < 3.0:
            assert time.monotonic() < deadline and not failures, failures[:3]
            time.sleep(0.05)
        assert remote_count() - cut_remote <= 8  # at most what was answered around the cut

        _ip("link", "set", veth, "up")
        deadline = time.monotonic() + 60
        while remote_count() < cut_remote + 20:  # registered again by itself, and served again
            assert time.monotonic() < deadline, f"the remote engine never served again: {served}\n{host.output()}"
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(timeout=90)
        assert not failures, failures[:3]
        assert sum(served.values()) == sent[0]  # every request answered, exactly once
    finally:
        stop_code = host.stop()
    assert stop_code == 0, host.output()
    assert "lost: no heartbeat" in c.log("broker")

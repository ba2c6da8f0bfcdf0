"""Authenticated tcp on loopback: CURVE clients and a worker host (`zserve workers`) with good and unknown
keys, against a real broker and engine."""

from __future__ import annotations

import asyncio
import stat
import subprocess
import sys
import time

import pytest
from cluster import subprocess_env
from deployment import free_port
from multihost import WorkerHostProc, broker_toml, make_keys, workers_toml

import zserve
from zserve.keys import AuthenticationFailed, CurveKeys

MODEL = """
[[models]]
name = "echo"
handler = "testmodels:SlowEcho"
engines = 1
max_batch_size = 8
max_wait_ms = 2
[models.options]
delay_s = 0.005
"""


def test_keys_generate_writes_a_pair_with_a_private_secret_and_never_overwrites(tmp_path):
    argv = [sys.executable, "-m", "zserve.cli", "keys", "generate", str(tmp_path / "k"), "--name", "gpu1"]
    first = subprocess.run(argv, capture_output=True, text=True, env=subprocess_env(), timeout=60)
    assert first.returncode == 0, first.stderr
    secret = tmp_path / "k" / "gpu1.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) & 0o077 == 0
    keys = CurveKeys.load(secret, tmp_path / "k" / "gpu1.key")
    assert len(keys.public) == len(keys.secret) == 40 and keys.public == keys.server_public
    assert "secret-key" not in (tmp_path / "k" / "gpu1.key").read_text()  # the public file holds no secret
    again = subprocess.run(argv, capture_output=True, text=True, env=subprocess_env(), timeout=60)
    assert again.returncode == 2 and "not overwritten" in again.stderr
    with pytest.raises(ValueError, match="no secret key"):
        CurveKeys.load(tmp_path / "k" / "gpu1.key", tmp_path / "k" / "gpu1.key")


@pytest.fixture
def curve_cluster(cluster_factory, tmp_path):
    keys = tmp_path / "keys"
    auth = make_keys(keys, "broker", "alice", "mallory", "hostb", "stranger", authorized=("alice", "hostb"))
    assert auth.is_dir()
    ports = (free_port(), free_port(), free_port())
    c = cluster_factory(broker_toml("127.0.0.1", ports, keys) + MODEL)
    c.start_broker()
    c.start_engine("echo", 0)
    c.wait_ready({"echo": 1})
    return c, keys, ports


def test_curve_client_with_an_authorized_key_is_served_and_an_unknown_one_is_refused(curve_cluster):
    c, keys, ports = curve_cluster
    endpoint = f"tcp://127.0.0.1:{ports[0]}"
    good = CurveKeys.load(keys / "alice.key_secret", keys / "broker.key")
    with zserve.Client(endpoint, curve_keys=good) as client:
        assert client.predict("echo", "hi")["echo"] == "hi"
    bad = CurveKeys.load(keys / "mallory.key_secret", keys / "broker.key")
    with zserve.Client(endpoint, curve_keys=bad) as client:
        started = time.monotonic()
        with pytest.raises(AuthenticationFailed, match="refused our CURVE key"):
            client.predict("echo", "let me in")
        assert time.monotonic() - started < 10
    with zserve.Client(endpoint) as client:  # no CURVE at all: never served
        with pytest.raises(zserve.BrokerUnavailable):
            client.health(timeout_s=1.0)
    assert "refused a connection" in c.log("broker")


def test_async_client_speaks_curve_and_is_refused_with_an_unknown_key(curve_cluster):
    _, keys, ports = curve_cluster
    endpoint = f"tcp://127.0.0.1:{ports[0]}"

    async def ask(name: str) -> object:
        async with zserve.AsyncClient(
            endpoint, curve_keys=CurveKeys.load(keys / f"{name}.key_secret", keys / "broker.key")
        ) as client:
            return (await asyncio.wait_for(client.predict("echo", "async"), 10))["echo"]

    assert asyncio.run(ask("alice")) == "async"
    with pytest.raises(AuthenticationFailed):
        asyncio.run(ask("mallory"))


def test_worker_host_joins_over_curve_and_one_with_an_unknown_key_is_refused(curve_cluster, tmp_path):
    c, keys, ports = curve_cluster
    hosts = []
    for name in ("hostb", "stranger"):
        path = tmp_path / f"{name}.toml"
        run_dir = tmp_path / f"run-{name}"
        path.write_text(workers_toml("127.0.0.1", ports, keys, name, run_dir, MODEL))
        hosts.append(WorkerHostProc(path, tmp_path / f"{name}.log"))
    try:
        c.wait_ready({"echo": 2})  # the local engine and hostb's
        hosts[1].wait_for("refused this host's CURVE key")
        assert c.client().health().models[0].ready_workers == 2  # the stranger never registered
        remote = hosts[0].wait_for("registered")
        client = c.client()
        pids = {f.result(timeout=30)["pid"] for f in [client.submit("echo", i) for i in range(200)]}
        assert len(pids) == 2, (pids, remote)
    finally:
        for host in hosts:
            assert host.stop() == 0, host.output()
    # The refused engine's Leave finds no broker connected: it must not block its stop (a DEALER's send would,
    # and its supervisor killed it after shutdown_timeout_s, 20 s, in about half of the runs)
    assert "did not stop in" not in hosts[1].output(), hosts[1].output()
    assert "echo-0@hostb" in c.log("broker")
    assert not any(p.name.startswith("run-") and p.exists() for p in tmp_path.iterdir() if p.is_dir())


def test_tcp_without_keys_or_plain_tcp_beyond_loopback_is_rejected():
    from zserve.config import ConfigError, parse_config

    base = '[[models]]\nname = "m"\nhandler = "zserve.models.echo:Echo"\n'
    with pytest.raises(ConfigError, match="needs curve_key and authorized_keys_dir"):
        parse_config('[broker]\nwork_endpoint = "tcp://0.0.0.0:7000"\n' + base)
    with pytest.raises(ConfigError, match="loopback only"):
        parse_config('[broker]\nwork_endpoint = "tcp://0.0.0.0:7000"\ninsecure = true\n' + base)
    with pytest.raises(ConfigError, match="must look like tcp://HOST:PORT"):
        parse_config('[broker]\nwork_endpoint = "ipc:///tmp/x"\ninsecure = true\n' + base)
    exposed = '[broker]\nwork_endpoint = "tcp://0.0.0.0:7000"\ninsecure = true\ninsecure_any_host = true\n'
    ok = parse_config(exposed + base)
    assert ok.broker.work_endpoint == "tcp://0.0.0.0:7000"
    assert parse_config('[broker]\nout_endpoint = "tcp://[::1]:7001"\ninsecure = true\n' + base).broker.insecure


def test_workers_config_needs_the_remote_endpoints_and_keys(tmp_path):
    from zserve.config import ConfigError
    from zserve.deploy.worker_host import load_workers_config

    path = tmp_path / "w.toml"
    path.write_text('[broker]\nwork_endpoint = "tcp://10.0.0.1:1"\nout_endpoint = "tcp://10.0.0.1:2"\n' + MODEL)
    with pytest.raises(ConfigError, match="curve_key and broker_key are required"):
        load_workers_config(path)
    path.write_text('[broker]\nwork_endpoint = ""\nout_endpoint = "tcp://10.0.0.1:2"\ninsecure = true\n' + MODEL)
    with pytest.raises(ConfigError, match="work_endpoint is required"):
        load_workers_config(path)
    path.write_text('[broker]\nwork_endpoint = "tcp://h:1"\nout_endpoint = "tcp://h:2"\ninsecure = true\n' + MODEL)
    assert load_workers_config(path).models[0].name == "echo"


def test_zserve_up_with_a_missing_broker_key_is_a_config_error(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(broker_toml("127.0.0.1", (free_port(), free_port(), free_port()), tmp_path / "nokeys") + MODEL)
    argv = [sys.executable, "-m", "zserve.cli", "up", "-c", str(path)]
    run = subprocess.run(argv, capture_output=True, text=True, env=subprocess_env(), timeout=60)
    assert run.returncode == 2 and "broker.curve_key: cannot read CURVE key" in run.stderr, run.stderr

"""The default deployment (supervisor.toml) under the real supervisord, from `zserve supervisord-conf`:
it serves every model; restarting an engine under load loses no request; `stop all` leaves no process;
`zserve status` says ready (exit 0) while it serves and not ready (exit 1) once it is stopped."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from cluster import subprocess_env
from deployment import Deployment, Supervisord, alive, free_port, wait_http_ready

from zserve.config import load_config, to_toml

REPO = Path(__file__).resolve().parents[2]


def zserve_status(config_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zserve.cli", "status", "-c", str(config_path)],
        capture_output=True, text=True, timeout=60, env=subprocess_env(),
    )  # fmt: skip


@pytest.fixture(scope="module")
def supervised(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("supervisord")
    config = load_config(REPO / "supervisor.toml")
    config.frontends.port = free_port()
    config.supervisor.run_dir = tempfile.mkdtemp(prefix="zs-")  # short: ipc paths must fit in 107 bytes
    config_path = tmp / "supervisor.toml"
    config_path.write_text(to_toml(config))
    sd = Supervisord(config_path, Path(tempfile.mkdtemp(prefix="zsd-")))
    sd.url = f"http://127.0.0.1:{config.frontends.port}"
    sd.config_path = config_path
    try:
        wait_http_ready(sd.url, sd.proc)
    except RuntimeError as exc:
        sd.shutdown()
        raise AssertionError(f"{exc}\n{sd.logs()}") from None
    yield sd
    assert sd.shutdown() == 0, sd.logs()


def test_supervisord_serves_every_default_model_and_status_says_ready(supervised):
    d = Deployment.__new__(Deployment)  # only its request helper, against supervisord's frontend
    d.url = supervised.url
    assert d.request("POST", "/v1/models/echo/predict", {"hi": 1})[2] == {"hi": 1}
    status, _, body = d.request("POST", "/v1/models/minilm/predict", {"text": "hello world"})
    assert status == 200 and len(body["embedding"]) == 384
    status, _, chat = d.request(
        "POST", "/v1/chat/completions",
        {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
    )  # fmt: skip
    assert status == 200 and chat["usage"]["completion_tokens"] >= 1, chat
    programs = supervised.ctl("status")
    for name in ("broker", "engine-echo-0", "engine-minilm-0", "stage-minilm-0", "engine-smollm2-0", "frontend"):
        assert f"zserve:{name}" in programs and "RUNNING" in programs.split(f"zserve:{name}")[1].splitlines()[0]

    out = zserve_status(supervised.config_path)
    assert out.returncode == 0, out.stdout + out.stderr
    table = out.stdout.splitlines()
    for model in ("echo", "minilm", "smollm2"):
        assert any(line.split()[:2] == [model, "1"] for line in table), out.stdout  # one ready engine each
    assert table[-1] == "ready"


def test_restarting_an_engine_under_load_loses_no_request(supervised):
    d = Deployment.__new__(Deployment)
    d.url = supervised.url
    statuses: list[int] = []
    stop = threading.Event()

    def load() -> None:
        i = 0
        while not stop.is_set():
            status, _, body = d.request("POST", "/v1/models/echo/predict", {"i": i})
            statuses.append(status if body == {"i": i} else -status)
            i += 1

    old_pid = supervised.ctl("pid", "zserve:engine-echo-0").strip()
    threads = [threading.Thread(target=load) for _ in range(8)]
    for t in threads:
        t.start()
    while len(statuses) < 200:  # under load before the restart
        threading.Event().wait(0.05)
    out = supervised.ctl("restart", "zserve:engine-echo-0")
    assert "started" in out, out
    after = len(statuses)
    wait_http_ready(supervised.url, supervised.proc)
    while len(statuses) < after + 200:  # and served by the new engine after it
        threading.Event().wait(0.05)
    stop.set()
    for t in threads:
        t.join()
    assert supervised.ctl("pid", "zserve:engine-echo-0").strip() != old_pid
    assert set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}


def test_stop_all_leaves_no_process_and_status_says_not_ready(supervised):
    everything = supervised.descendants()
    assert len(everything) >= 6
    out = supervised.ctl("stop", "all")
    assert "frontend: stopped" in out and "broker: stopped" in out, out
    assert alive(everything) == []
    assert supervised.descendants() == []
    out = zserve_status(supervised.config_path)
    assert out.returncode == 1 and "NOT READY" in out.stdout, out.stdout

"""The supervisor: restart with backoff, giving up loudly, config errors, clean stop."""

from __future__ import annotations

import signal
import subprocess
import sys

from cluster import subprocess_env
from deployment import Deployment, alive, free_port, write_config

from zserve.config import load_config, run_dir_for

ONE_MODEL = """
[supervisor]
restart_backoff_s = 0.2
max_restarts = {max_restarts}

[broker]
heartbeat_interval_ms = 100

[frontends]
workers = 2
port = {port}

[[models]]
name = "m"
handler = "{handler}"
"""


def test_crashed_engine_is_restarted_and_sigterm_leaves_nothing_running(tmp_path):
    path = write_config(tmp_path, ONE_MODEL.format(port=free_port(), handler="testmodels:SlowEcho", max_restarts=3))
    d = Deployment(path).wait_ready()
    assert d.request("POST", "/v1/models/m/predict", {"a": 1})[0] == 200
    d.wait_frontend_workers(2)  # ready means one serves; the second may still be booting on a busy machine
    children = d.descendants()
    names = " ".join(" ".join(p.cmdline()) for p in children)
    assert "zserve.broker.broker" in names and "zserve.workers.engine" in names and "gunicorn" in names
    assert len([p for p in children if p.cmdline()[1:3] == ["-m", "gunicorn"]]) == 3  # master + 2 workers
    run_dir = run_dir_for(load_config(path), path)
    assert run_dir.stat().st_mode & 0o777 == 0o700

    second = Deployment(path)  # same config, same run dir: must refuse, not steal the sockets
    assert second.proc.wait(timeout=60) == 1
    second._reader.join(timeout=5)
    assert f"(pid {d.proc.pid}) is already running" in second.output

    engine = next(p for p in children if "zserve.workers.engine" in " ".join(p.cmdline()))
    engine.send_signal(signal.SIGKILL)
    died = d.wait_for_line("engine-m-0 exited with code -9; restarting")
    d.wait_for_line("registered", timeout_s=60, after=died)
    status, _, body = d.request("POST", "/v1/models/m/predict", {"a": 2})
    assert status == 200 and body["pid"] != engine.pid

    everything = d.descendants()
    assert d.stop() == 0, d.output
    assert alive(everything) == []
    assert not run_dir.exists()
    for prefix in ("broker ", "engine-m-0 ", "frontend ", "supervisor "):
        assert any(line.startswith(prefix) for line in d.lines), prefix


def test_an_engine_that_cannot_start_makes_the_supervisor_give_up_loudly(tmp_path):
    path = write_config(tmp_path, ONE_MODEL.format(port=free_port(), handler="testmodels:Broken", max_restarts=1))
    d = Deployment(path)
    code = d.proc.wait(timeout=120)
    d._reader.join(timeout=5)
    assert code == 1
    assert "weights not found (on purpose)" in d.output
    assert "giving up" in d.output


def test_bad_config_exits_non_zero_naming_the_key(tmp_path):
    path = write_config(
        tmp_path, ONE_MODEL.format(port=free_port(), handler="x:Y", max_restarts=1) + "max_wait_ms = -1\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "zserve.cli", "up", "-c", str(path)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2
    assert "models[0].max_wait_ms" in run.stderr
    run = subprocess.run([sys.executable, "-m", "zserve.cli", "up", "--help"], capture_output=True, text=True)
    assert run.returncode == 0 and "--config" in run.stdout and "--port" in run.stdout


def test_a_preprocess_that_needs_what_only_setup_creates_fails_at_start_up(tmp_path):
    toml = ONE_MODEL.format(port=free_port(), handler="testmodels:MisplacedTokenizer", max_restarts=1)
    run = subprocess.run(
        [sys.executable, "-m", "zserve.cli", "up", "-c", str(write_config(tmp_path, toml))],
        capture_output=True,
        text=True,
        timeout=60,
        env=subprocess_env(),
    )
    assert run.returncode == 2
    assert "preprocess uses self.tokenizer" in run.stderr and "setup_preprocess" in run.stderr


def test_sigterm_during_start_up_stops_cleanly_with_exit_0(tmp_path):
    path = write_config(tmp_path, ONE_MODEL.format(port=free_port(), handler="testmodels:SlowEcho", max_restarts=1))
    d = Deployment(path)
    d.wait_for_line("started engine-m-0")  # the supervisor is waiting for the engine to register
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=60) == 0, d.output
    d._reader.join(timeout=5)
    assert "zserve ready" in d.output or "stopped during start-up" in d.output
    assert "gave up" not in d.output

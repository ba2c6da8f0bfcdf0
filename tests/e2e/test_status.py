"""`zserve status` against `zserve up`: the supervisor's process table (pids, restarts) and the broker's
per-model view; exit 0 while every model is ready, 1 once the deployment is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from cluster import subprocess_env
from deployment import Deployment, free_port, write_config

from zserve.versions import library_versions

CONFIG = """
[supervisor]
restart_backoff_s = 0.2

[broker]
heartbeat_interval_ms = 100

[frontends]
workers = 1
port = {port}

[[models]]
name = "m"
handler = "testmodels:SlowEcho"
credits = 3
"""


def zserve_status(path) -> tuple[int, dict[str, list[str]], str]:
    run = subprocess.run([sys.executable, "-m", "zserve.cli", "status", "-c", str(path)],
                         capture_output=True, text=True, timeout=60, env=subprocess_env())  # fmt: skip
    rows = {line.split()[0]: line.split() for line in run.stdout.splitlines() if line.strip()}
    return run.returncode, rows, run.stdout


def test_status_shows_processes_restarts_and_models(tmp_path):
    path = write_config(tmp_path, CONFIG.format(port=free_port()))
    d = Deployment(path).wait_ready()
    try:
        code, rows, out = zserve_status(path)
        assert code == 0 and out.rstrip().endswith("ready"), out
        header = rows["PROCESS"]
        engine = dict(zip(header, rows["engine-m-0"], strict=True))
        assert engine["ROLE"] == "engine" and engine["RESTARTS"] == "0" and engine["STATE"] == "running"
        pids = {p.pid for p in d.descendants()}
        assert {int(rows[name][2]) for name in ("broker", "engine-m-0", "frontend")} <= pids
        assert rows["m"][:5] == ["m", "1", "0", "0", "0"]  # one engine, none busy, no stage, empty queue
        assert f"engines of m: {library_versions()}" in out  # what the engine said in its Hello

        os_pid = int(engine["PID"])
        os.kill(os_pid, signal.SIGKILL)
        died = d.wait_for_line("engine-m-0 exited with code -9; restarting")
        d.wait_for_line("registered", timeout_s=60, after=died)
        code, rows, out = zserve_status(path)
        restarted = dict(zip(header, rows["engine-m-0"], strict=True))
        assert restarted["RESTARTS"] == "1" and int(restarted["PID"]) != os_pid, out
    finally:
        assert d.stop() == 0, d.output
    code, _, out = zserve_status(path)
    assert code == 1 and "NOT READY" in out and "no `zserve up` supervisor" in out, out

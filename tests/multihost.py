"""Helpers for the multi-host tests: CURVE keys, a broker config with tcp endpoints, `zserve workers`."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from cluster import subprocess_env

from zserve.keys import generate


def make_keys(root: Path, *names: str, authorized: tuple[str, ...] = ()) -> Path:
    """root/NAME.key{,_secret} for each name; root/authorized/ holds the public keys of ``authorized``."""
    for name in names:
        generate(root, name)
    auth = root / "authorized"
    auth.mkdir()
    for name in authorized:
        (auth / f"{name}.key").write_bytes((root / f"{name}.key").read_bytes())
    return auth


def broker_toml(host: str, ports: tuple[int, int, int], keys: Path, interval_ms: int = 100) -> str:
    client, work, out = (f"tcp://{host}:{p}" for p in ports)
    return f"""
[broker]
client_endpoint = "{client}"
work_endpoint = "{work}"
out_endpoint = "{out}"
curve_key = "{keys}/broker.key_secret"
authorized_keys_dir = "{keys}/authorized"
heartbeat_interval_ms = {interval_ms}
heartbeat_liveness = 4
"""


def workers_toml(host: str, ports: tuple[int, int, int], keys: Path, name: str, run_dir: Path, models: str) -> str:
    _, work, out = (f"tcp://{host}:{p}" for p in ports)
    return f"""
host_name = "{name}"
[supervisor]
run_dir = "{run_dir}"
restart_backoff_s = 0.2
[broker]
work_endpoint = "{work}"
out_endpoint = "{out}"
curve_key = "{keys}/{name}.key_secret"
broker_key = "{keys}/broker.key"
heartbeat_interval_ms = 100
heartbeat_liveness = 4
{models}
"""


class WorkerHostProc:
    """`zserve workers -c FILE` as a subprocess (optionally inside a network namespace), output to a log."""

    def __init__(self, config: Path, log: Path, netns: str | None = None) -> None:
        argv = [sys.executable, "-m", "zserve.cli", "workers", "-c", str(config)]
        if netns:
            argv = ["ip", "netns", "exec", netns, *argv]
        self.log = log
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(argv, env=subprocess_env(), stdout=f, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, text: str, timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        while text not in self.output():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise TimeoutError(f"no {text!r} from zserve workers (exit {self.proc.poll()}):\n{self.output()}")
            time.sleep(0.05)
        return self.output()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

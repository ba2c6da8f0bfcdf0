"""Real processes for integration tests: a broker and engines as subprocesses over ipc, started with the
same command lines the supervisor uses. Readiness comes from the broker's health report, never a sleep."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from zserve import Client
from zserve.config import parse_config
from zserve.deploy.plan import plan

SUPPORT = Path(__file__).resolve().parent / "support"


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SUPPORT), env.get("PYTHONPATH")]))
    return env


class Cluster:
    def __init__(self, toml: str, log_dir: Path) -> None:
        # A short private run dir: ipc paths must fit in 107 bytes, pytest's tmp paths may not.
        self.run_dir = Path(tempfile.mkdtemp(prefix="zs-"))
        self.config = parse_config(f'[supervisor]\nrun_dir = "{self.run_dir}"\n' + toml)
        self.config_path = log_dir / "supervisor.toml"
        self.plan = plan(self.config, self.config_path)
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.clients: list[Client] = []

    def _spawn(self, child) -> subprocess.Popen:
        env = {**child.environ(dict(os.environ)), **subprocess_env()}
        log = open(self.log_dir / f"{child.name}.log", "ab")
        proc = subprocess.Popen(child.argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.procs[child.name] = proc
        return proc

    def start_broker(self) -> subprocess.Popen:
        return self._spawn(self.plan.broker())

    def start_engine(self, model: str, index: int = 0) -> subprocess.Popen:
        return self._spawn(self.plan.engine(self.config.model(model), index))

    def start_stage(self, model: str, index: int = 0) -> subprocess.Popen:
        return self._spawn(self.plan.stage(self.config.model(model), index))

    def client(self, **kwargs) -> Client:
        client = Client(self.plan.endpoints.client, **kwargs)
        self.clients.append(client)
        return client

    def wait_ready(
        self, engines: dict[str, int], timeout_s: float = 60.0, stages: dict[str, int] | None = None
    ) -> None:
        client = self.client()
        deadline = time.monotonic() + timeout_s
        while True:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}: {self.log(name)}")
            try:
                report = client.health(timeout_s=0.5)
                ready = {m.name: m.ready_workers for m in report.models}
                staged = {m.name: m.preprocess_workers for m in report.models}
                if all(ready.get(m, 0) >= n for m, n in engines.items()) and all(
                    staged.get(m, 0) >= n for m, n in (stages or {}).items()
                ):
                    return
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"engines {engines} not ready in {timeout_s}s")
            time.sleep(0.05)

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        for client in self.clients:
            client.close()
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.run_dir, ignore_errors=True)

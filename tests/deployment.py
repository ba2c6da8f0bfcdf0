"""``zserve up`` as a subprocess, for e2e tests: readiness is its ``zserve ready:`` line."""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
from cluster import subprocess_env

from zserve.transport import free_tcp_port

free_port = free_tcp_port


_STARTED: list[Deployment] = []


def stop_leftovers() -> None:
    """Stop every deployment a test started and did not stop (it failed before its ``stop``): ``zserve up``
    outlives the test run otherwise, and its processes would load the machine for whatever runs next."""
    for d in _STARTED:
        if d.proc.poll() is None:
            try:
                d.stop(timeout_s=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(psutil.NoSuchProcess):
                    for p in [*d.descendants(), psutil.Process(d.proc.pid)]:
                        p.kill()


class Deployment:
    def __init__(self, config_path: Path | None, *args: str, command: tuple[str, ...] = ()) -> None:
        """``zserve up -c config_path *args``, or ``zserve *command`` (e.g. ``("serve", folder)``)."""
        self.config_path = config_path
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.url = ""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "zserve.cli", *(command or ("up", "-c", str(config_path))), *args],
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        _STARTED.append(self)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("zserve ready: "):
                self.url = line.split(": ", 1)[1].strip()
                self.ready.set()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout_s: float = 180.0) -> Deployment:
        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop(timeout_s=30)
                raise RuntimeError(f"zserve up did not get ready (exit {self.proc.poll()}):\n{self.output}")
        return self

    def wait_for_line(self, text: str, timeout_s: float = 60.0, after: int = 0) -> int:
        """Wait for an output line containing ``text`` among the lines from index ``after`` on (pass the
        previous call's result to wait for a *new* occurrence); returns the index just past it."""
        deadline = time.monotonic() + timeout_s
        while True:
            for i in range(after, len(self.lines)):
                if text in self.lines[i]:
                    return i + 1
            if time.monotonic() > deadline:
                raise TimeoutError(f"no line with {text!r} after line {after} in:\n{self.output}")
            time.sleep(0.05)

    def wait_frontend_workers(self, n: int, timeout_s: float = 60.0) -> None:
        """Wait for ``n`` gunicorn workers' ready lines (``zserve up`` is ready once one of them serves)."""
        after = seen = 0
        while seen < n:
            after = self.wait_for_line(" ready", timeout_s, after)
            seen += bool(re.search(r"frontend worker \d+ ready", self.lines[after - 1]))

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            self._reader.join(timeout=5)

    def request(self, method: str, path: str, body: bytes | str | dict | None = None, headers: dict | None = None):
        """(status, headers, parsed JSON or raw text) over a fresh connection."""
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        if isinstance(body, dict):
            body = json.dumps(body)
        try:
            conn.request(method, path, body=body, headers=headers or {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        try:
            parsed = json.loads(data)
        except ValueError:
            parsed = data.decode(errors="replace")
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, parsed


def write_config(tmp_path: Path, toml: str) -> Path:
    path = tmp_path / "supervisor.toml"
    path.write_text(toml)
    return path


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def http_get(url: str, path: str, timeout_s: float = 5.0) -> tuple[int, str]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


def wait_http_ready(url: str, proc: subprocess.Popen, timeout_s: float = 300.0, what: str = "") -> None:
    """Poll ``url``/readyz until 200; fail early if ``proc`` (what serves it) exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if http_get(url, "/readyz", timeout_s=2)[0] == 200:
                return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url}/readyz never answered 200 (exit {proc.poll()}); {what}")
        time.sleep(0.2)


class Supervisord:
    """The real supervisord (pip `supervisor`) in the foreground on a rendered `zserve supervisord-conf`."""

    def __init__(self, config_path: Path, state_dir: Path) -> None:
        self.conf = state_dir / "supervisord.conf"
        self.state_dir = state_dir
        render = subprocess.run(
            [sys.executable, "-m", "zserve.cli", "supervisord-conf", "-c", str(config_path), "--dir", str(state_dir),
             "-o", str(self.conf)],
            capture_output=True, text=True, env=subprocess_env(), timeout=60,
        )  # fmt: skip
        assert render.returncode == 0, render.stderr
        bin_dir = Path(sys.executable).parent
        self.ctl_argv = [str(bin_dir / "supervisorctl"), "-c", str(self.conf)]
        self.proc = subprocess.Popen(
            [str(bin_dir / "supervisord"), "-n", "-c", str(self.conf)],
            env=subprocess_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def ctl(self, *args: str, timeout_s: float = 120) -> str:
        run = subprocess.run([*self.ctl_argv, *args], capture_output=True, text=True, timeout=timeout_s)
        return run.stdout + run.stderr

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.state_dir.glob("*.log"))

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def shutdown(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # supervisord stops its programs in reverse priority, then exits
        try:
            return self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

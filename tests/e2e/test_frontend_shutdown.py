"""A frontend worker told to stop (SIGTERM to ``zserve up``) closes its idle keep-alive connections at once, on
the fast path and on the falcon app's path alike, instead of leaving each open until its keep-alive time, and a
request in flight when the stop begins still gets its one whole answer, with ``Connection: close``
(zserve/frontends/fast_http.py, ``FastConnections.drain``). Real gunicorn, real sockets."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from deployment import Deployment, free_port, write_config
from raw_http import GET_MODELS, Conn, predict

from zserve.frontends.fast_http import SWEEP_INTERVAL_S

KEEP_ALIVE_S = 20  # [frontends] keep_alive_s: long, so that waiting for it out is told apart from a prompt close

CONFIG = """
[frontends]
workers = 1
port = {port}
keep_alive_s = {keep_alive_s}

[[models]]
name = "echo"
handler = "testmodels:SlowEcho"
[models.options]
delay_s = 0.0

[[models]]
name = "gate"
handler = "shutdown_gate:Gate"
engines = 2  # one request each (credits 1, batches of 1): both are computing when the stop begins
credits = 1
max_batch_size = 1
[models.options]
folder = "{folder}"
"""

# The engine imports it by name, from the test's folder (put on its PYTHONPATH).
GATE = '''
import time
from pathlib import Path

from zserve import Model


class Gate(Model):
    """Echo of ``{"i": N}`` items that says when it computes one (the file ``started-N``) and holds its batch
    until the file ``release`` exists."""

    def __init__(self, folder: str = "") -> None:
        super().__init__(folder=folder)
        self.folder = Path(folder)

    def predict(self, batch):
        for item in batch:
            (self.folder / f"started-{item['i']}").touch()
        while not (self.folder / "release").exists():
            time.sleep(0.01)
        return [{"echo": item} for item in batch]
'''


def start(tmp_path: Path, monkeypatch) -> Deployment:
    (tmp_path / "shutdown_gate.py").write_text(GATE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    toml = CONFIG.format(port=free_port(), keep_alive_s=KEEP_ALIVE_S, folder=tmp_path)
    return Deployment(write_config(tmp_path, toml)).wait_ready()


def wait_for_file(path: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} was not written in {timeout_s} s"
        time.sleep(0.02)


def test_idle_keep_alive_connections_close_at_once_when_the_frontend_stops(tmp_path, monkeypatch):
    d = start(tmp_path, monkeypatch)
    conns = []
    try:
        fast, app, silent = Conn(d), Conn(d), Conn(d)  # silent: connected, and never sends
        conns += [fast, app, silent]
        fast.send(predict("echo", b'{"i": 1}'))
        status, headers, _ = fast.response()
        assert (status, headers["server"]) == (200, "zserve") and headers.get("connection") != "close"
        app.send(GET_MODELS)  # this connection is the falcon app's from now on
        status, headers, _ = app.response()
        assert (status, headers["server"]) == (200, "gunicorn/asgi") and headers.get("connection") != "close"

        started = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        for conn in conns:  # EOF (or a reset), not a hang: a socket timeout (30 s) would fail the test
            assert conn.closed_by_server()
        closed_s = time.monotonic() - started
        assert d.proc.wait(timeout=60) == 0, d.output
        stopped_s = time.monotonic() - started
    finally:
        for conn in conns:
            conn.close()
        d.stop()
    # Before, the worker waited out its connections' --keep-alive (keep_alive_s + 1 = 21 s here) up to
    # graceful_timeout_s (10 s), and the stop with it.
    assert closed_s < KEEP_ALIVE_S / 4, f"idle connections closed {closed_s:.1f} s after the stop began"
    assert stopped_s < KEEP_ALIVE_S / 2, f"the deployment stopped in {stopped_s:.1f} s\n{d.output}"


def test_a_request_in_flight_when_the_stop_begins_gets_its_whole_answer(tmp_path, monkeypatch):
    """Requests computing, and requests whose head is half sent, when the stop begins: each is answered once, with
    Connection: close, on either path, while the idle connections beside them close at once."""
    d = start(tmp_path, monkeypatch)
    conns = []
    try:
        fast, app, idle, idle_app, half, half_app, piped_app, handed_app = conns = [Conn(d) for _ in range(8)]
        fast.send(predict("gate", b'{"i": 1}'))
        app.send(predict("gate", b'{"i": 2}', b"X-Zserve-Priority: 0\r\n"))  # the priority header: the falcon route
        for i in (1, 2):  # both requests are computing
            wait_for_file(tmp_path / f"started-{i}")
        for conn, request in ((idle, predict("echo", b'{"i": 3}')), (idle_app, GET_MODELS), (half_app, GET_MODELS)):
            conn.send(request)
            assert conn.response()[0] == 200
        echo = predict("echo", b'{"i": 4}')
        half.send(echo[:30])  # a head begun on each path
        half_app.send(GET_MODELS[:20])
        # a head begun in the bytes behind a whole request: gunicorn feeds them to its parser again once that
        # request is answered, not through data_received; on a handed-over connection, and in the handover's bytes
        piped_app.send(GET_MODELS)
        assert piped_app.response()[0] == 200
        for conn in (piped_app, handed_app):
            conn.send(GET_MODELS + GET_MODELS[:20])
            assert conn.response()[0] == 200

        after = len(d.lines)
        d.proc.send_signal(signal.SIGTERM)
        d.wait_for_line("Worker shutting down", after=after)  # gunicorn's worker has closed its listener
        shutting_down = time.monotonic()
        for conn in (idle, idle_app):  # closed while the worker still waits for the requests in progress
            assert conn.closed_by_server()
        closed_s = time.monotonic() - shutting_down
        assert closed_s < KEEP_ALIVE_S / 4, f"the idle connections closed {closed_s:.1f} s into the shutdown"
        time.sleep(2 * SWEEP_INTERVAL_S)  # more sweeps of the stopping worker: none may close a head begun
        half.send(echo[30:])
        for conn in (half_app, piped_app, handed_app):
            conn.send(GET_MODELS[20:])
        (tmp_path / "release").touch()
        answers = [(fast, "zserve", {"i": 1}), (app, "gunicorn/asgi", {"i": 2}), (half, "zserve", {"i": 4}),
                   (half_app, "gunicorn/asgi", None), (piped_app, "gunicorn/asgi", None),
                   (handed_app, "gunicorn/asgi", None)]  # fmt: skip
        for conn, server, item in answers:
            status, headers, body = conn.response()
            assert (status, headers["server"], headers.get("connection")) == (200, server, "close"), headers
            assert item is None or json.loads(body)["echo"] == item
            assert conn.buf == b"" and conn.closed_by_server()  # one answer, then the end of the connection
        assert d.proc.wait(timeout=60) == 0, d.output
    finally:
        (tmp_path / "release").touch()
        for conn in conns:
            conn.close()
        d.stop()

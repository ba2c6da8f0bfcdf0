"""Every request gets an HTTP answer under overload (issue 37, item 5), through `zserve up` and gunicorn, over raw
sockets: connections past a worker's `max_connections` get 503 + Retry-After + Connection: close (400 for bytes that
are not HTTP), never a close without an answer; a keep-alive connection reused just inside the idle time its answers
advertise (`Keep-Alive: timeout=N`) is still open."""

from __future__ import annotations

import json
import select
import socket
import time

import psutil
import pytest
from deployment import Deployment, free_port, write_config

MAX_CONNECTIONS = 4
KEEP_ALIVE_S = 1

CONFIG = f"""
[frontends]
workers = 1
port = {{port}}
max_connections = {MAX_CONNECTIONS}
keep_alive_s = {KEEP_ALIVE_S}

[[models]]
name = "echo"
handler = "zserve.models.echo:Echo"
"""

PREDICT = (
    b"POST /v1/models/echo/predict HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    b'Content-Length: 8\r\n\r\n{"x": 1}'
)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overload")
    d = Deployment(write_config(tmp, CONFIG.format(port=free_port()))).wait_ready()
    yield d
    assert d.stop() == 0, d.output


def connect(deployment: Deployment) -> socket.socket:
    host, port = deployment.url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response by its own framing; AssertionError if the server closes before a whole one."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed with no answer (read {buf!r})"
        buf += chunk
    head, body = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = sock.recv(65536)
        assert chunk, "connection closed inside a body"
        body += chunk
    return int(lines[0].split()[1]), headers, body


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_connections_past_the_limit_are_answered_503_not_closed(deployment):
    # Three times the limit, all open at once: the first requests are served, the rest refused with an answer.
    socks = [connect(deployment) for _ in range(3 * MAX_CONNECTIONS)]
    try:
        for s in socks:
            s.sendall(PREDICT)
        answers = [read_response(s) for s in socks]  # fails on any connection closed without an answer
        statuses = [status for status, _, _ in answers]
        assert set(statuses) <= {200, 503}, statuses
        # The supervisor's readiness probe may hold one of the worker's connections for a moment.
        assert MAX_CONNECTIONS - 1 <= statuses.count(200) <= MAX_CONNECTIONS, statuses
        for (status, headers, body), s in zip(answers, socks, strict=True):
            if status == 503:
                assert headers["retry-after"] == "1" and headers["connection"] == "close"
                error = json.loads(body)["error"]
                assert error["type"] == "overloaded" and "max_connections" in error["message"]
                assert closed_by_server(s)
        # The served connections stay usable.
        served = [s for (status, _, _), s in zip(answers, socks, strict=True) if status == 200]
        for s in served:
            s.sendall(PREDICT)
            assert read_response(s)[0] == 200
    finally:
        for s in socks:
            s.close()
    # Their slots free again: a new connection is served.
    deadline = time.monotonic() + 10
    while True:
        s = connect(deployment)
        try:
            s.sendall(PREDICT)
            status = read_response(s)[0]
        finally:
            s.close()
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert status == 200


@pytest.fixture(scope="module")
def asyncio_deployment(tmp_path_factory):
    """The same deployment on asyncio's own event loop (gunicorn's asgi worker takes uvloop when installed)."""
    tmp = tmp_path_factory.mktemp("overload-asyncio")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GUNICORN_CMD_ARGS", "--asgi-loop asyncio")
        d = Deployment(write_config(tmp, CONFIG.format(port=free_port()))).wait_ready()
    yield d
    assert d.stop() == 0, d.output


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_burst_of_connections_accepted_at_once_is_held_to_the_limit(request, loop):
    # asyncio builds the protocols of a whole accept burst before any connection_made runs: the limit must count
    # each connection as its protocol is built. The worker is stopped (SIGSTOP) while they connect, so that they
    # all wait in the listen backlog for one accept burst.
    deployment = request.getfixturevalue("deployment" if loop == "uvloop" else "asyncio_deployment")
    time.sleep(0.5)  # the previous test's connections are gone from the worker
    host, port = deployment.url.removeprefix("http://").rsplit(":", 1)
    server = next(p for p in psutil.Process(deployment.proc.pid).children() if p.cmdline()[1:3] == ["-m", "gunicorn"])
    (worker,) = server.children()
    socks = []
    worker.suspend()
    try:
        for _ in range(12 * MAX_CONNECTIONS):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex((host, int(port)))
            socks.append(s)
        time.sleep(0.2)  # the handshakes complete in the kernel; the connections wait to be accepted
        worker.resume()
        for s in socks:
            s.setblocking(True)
            s.settimeout(30)
            s.sendall(PREDICT)
        statuses = [read_response(s)[0] for s in socks]
        assert set(statuses) <= {200, 503}, statuses
        assert 1 <= statuses.count(200) <= MAX_CONNECTIONS, statuses
    finally:
        worker.resume()
        for s in socks:
            s.close()


def test_malformed_http_past_the_limit_is_a_400(deployment):
    held = [connect(deployment) for _ in range(MAX_CONNECTIONS)]
    try:
        for s in held:
            s.sendall(PREDICT)
            read_response(s)  # served or refused: either way the worker now holds them
        s = connect(deployment)
        try:
            s.sendall(b"POST /v1/models/echo/predict HTTP/1.1\r\nContent-Length: x\r\n\r\n")
            status, headers, body = read_response(s)
            assert status == 400 and json.loads(body)["error"]["type"] == "bad_request"
            assert headers["connection"] == "close" and closed_by_server(s)
        finally:
            s.close()
    finally:
        for s in held:
            s.close()


def test_a_connection_reused_just_inside_the_advertised_keep_alive_is_answered(deployment):
    time.sleep(0.5)  # the previous tests' connections are gone from the worker
    s = connect(deployment)
    try:
        s.sendall(PREDICT)
        status, headers, _ = read_response(s)
        assert status == 200 and headers["keep-alive"] == f"timeout={KEEP_ALIVE_S}"
        # A client whose pool expires connections at the advertised time reuses one up to just before it; the
        # server keeps it a second longer, so that reuse never meets its close.
        time.sleep(KEEP_ALIVE_S + 0.4)
        s.sendall(PREDICT)
        assert read_response(s)[0] == 200
        started = time.monotonic()
        assert closed_by_server(s)  # and idle, it is closed at keep_alive_s + 1
        assert KEEP_ALIVE_S < time.monotonic() - started < KEEP_ALIVE_S + 3
    finally:
        s.close()


def test_a_request_never_sent_whole_is_answered_408(deployment):
    s = connect(deployment)
    try:
        s.sendall(PREDICT[:-4])  # the body's last bytes never come
        status, headers, body = read_response(s)  # after the idle time, not a silent close
        assert status == 408 and json.loads(body)["error"]["type"] == "request_timeout"
        assert headers["connection"] == "close" and closed_by_server(s)
    finally:
        s.close()


def test_a_request_head_dripped_a_byte_at_a_time_is_answered_408(deployment):
    # Each byte comes well inside the idle time, so only the head's own deadline (the connection's idle time,
    # keep_alive_s + 1, from its first byte) answers it.
    s = connect(deployment)
    try:
        started = time.monotonic()
        for byte in PREDICT[:60]:  # the head is longer than what 8 s of dripping sends
            s.sendall(bytes([byte]))
            readable, _, _ = select.select([s], [], [], 0.4)
            if readable or time.monotonic() - started > 8:
                break
        assert readable, "no answer to a head dripped for 8 s"
        status, headers, body = read_response(s)
        assert status == 408 and json.loads(body)["error"]["type"] == "request_timeout"
        assert "head" in json.loads(body)["error"]["message"]
        assert headers["connection"] == "close" and closed_by_server(s)
        assert KEEP_ALIVE_S + 0.5 <= time.monotonic() - started < KEEP_ALIVE_S + 3  # swept every 0.25 s
    finally:
        s.close()


def test_a_request_head_never_sent_whole_past_the_limit_is_answered_408(deployment):
    held = [connect(deployment) for _ in range(MAX_CONNECTIONS)]
    try:
        for s in held:
            s.sendall(PREDICT)
            read_response(s)
        s = connect(deployment)
        try:
            s.sendall(PREDICT[:20])  # the head never ends
            status, headers, _ = read_response(s)
            assert status == 408 and headers["connection"] == "close"
        finally:
            s.close()
    finally:
        for s in held:
            s.close()

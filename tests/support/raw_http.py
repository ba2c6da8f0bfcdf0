"""A raw HTTP/1.1 client connection for the frontend's tests (tests/e2e/test_fast_http.py,
test_frontend_shutdown.py): requests sent as bytes (pipelined, or cut anywhere), responses read one at a time."""

from __future__ import annotations

import socket

from deployment import Deployment


class Conn:
    """One client connection that reads responses one at a time, by their own framing."""

    def __init__(self, deployment: Deployment) -> None:
        host, port = deployment.url.removeprefix("http://").rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=30)  # past keep-alive: a hang fails
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buf += chunk
        return bool(chunk)

    def response(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buf:
            assert self._fill(), f"connection closed before a response: {self.buf!r}"
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        length = int(headers.get("content-length", 0))
        while len(self.buf) < length:
            assert self._fill(), "connection closed inside a body"
        body, self.buf = self.buf[:length], self.buf[length:]
        return status, headers, body

    def closed_by_server(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


def predict(model: str, body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST /v1/models/%s/predict HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n%s\r\n%s" % (model.encode(), len(body), extra, body)
    )


GET_MODELS = b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n"

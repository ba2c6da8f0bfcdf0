"""The gunicorn frontend's fast HTTP path (zserve/frontends/fast_http.py), over raw sockets: predict requests are
answered by it (``Server: zserve``), every other request by the falcon app (``Server: gunicorn/asgi``), on
one keep-alive connection, pipelined, in order; HTTP framing errors and limits get JSON errors."""

from __future__ import annotations

import json
import time

import pytest
from deployment import Deployment, free_port, write_config
from raw_http import GET_MODELS, Conn, predict

CONFIG = """
[frontends]
workers = 1
port = {port}
max_body_bytes = 4096

[[models]]
name = "slow"
handler = "testmodels:SlowEcho"
max_batch_size = 16
max_wait_ms = 2
[models.options]
delay_s = 0.0

[[models]]
name = "picky"
handler = "testmodels:Picky"
"""


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fast")
    d = Deployment(write_config(tmp, CONFIG.format(port=free_port()))).wait_ready()
    yield d
    assert d.stop() == 0, d.output


def test_predict_takes_the_fast_path_and_other_routes_the_app_on_one_connection(deployment):
    conn = Conn(deployment)
    try:
        conn.send(predict("slow", b'{"i": 1}'))
        status, headers, body = conn.response()
        assert status == 200 and json.loads(body)["echo"] == {"i": 1}
        assert headers["server"] == "zserve" and int(headers["x-zserve-batch-size"]) >= 1
        assert headers["content-type"] == "application/json" and "date" in headers
        conn.send(GET_MODELS)  # the connection moves to the falcon app, and stays there
        status, headers, body = conn.response()
        assert status == 200 and headers["server"] == "gunicorn/asgi"
        assert [m["id"] for m in json.loads(body)["data"]] == ["slow", "picky"]
        conn.send(predict("slow", b'{"i": 2}'))
        status, headers, body = conn.response()
        assert status == 200 and json.loads(body)["echo"] == {"i": 2} and headers["server"] == "gunicorn/asgi"
    finally:
        conn.close()


def test_pipelined_requests_are_answered_in_order_across_the_handover(deployment):
    conn = Conn(deployment)
    try:
        burst = b"".join(predict("slow", b'{"i": %d}' % i) for i in range(40))
        conn.send(burst + predict("picky", b'{"reject": 1}') + GET_MODELS + predict("slow", b'{"i": 99}'))
        for i in range(40):
            status, headers, body = conn.response()
            assert (status, json.loads(body)["echo"], headers["server"]) == (200, {"i": i}, "zserve")
        status, _, body = conn.response()  # one bad item fails alone
        assert status == 400 and json.loads(body)["error"]["field"] == "reject"
        assert conn.response()[1]["server"] == "gunicorn/asgi"
        status, _, body = conn.response()
        assert status == 200 and json.loads(body)["echo"] == {"i": 99}
    finally:
        conn.close()


def test_a_long_pipeline_is_answered_whole_and_in_order(deployment):
    conn = Conn(deployment)  # past MAX_PIPELINED (64) and past one read: the rest waits unparsed, none is lost
    try:
        conn.send(b"".join(predict("slow", b'{"i": %d, "pad": "%s"}' % (i, b"x" * 200)) for i in range(500)))
        for i in range(500):
            status, _, body = conn.response()
            assert status == 200 and json.loads(body)["echo"]["i"] == i
    finally:
        conn.close()


def test_errors_match_the_app_and_bad_items_fail_alone(deployment):
    conn = Conn(deployment)
    try:
        conn.send(predict("picky", b"{not json") + predict("picky", b'"boom"') + predict("slow", b'{"ok": 1}'))
        status, _headers, body = conn.response()
        assert status == 400 and json.loads(body)["error"] == {
            "type": "bad_request",
            "message": json.loads(body)["error"]["message"],
            "field": "body",
        }
        status, _, body = conn.response()
        assert status == 500 and json.loads(body)["error"]["type"] == "model_error"
        status, _, body = conn.response()
        assert status == 200 and json.loads(body)["echo"] == {"ok": 1}
    finally:
        conn.close()
    # The same errors through the app's own path (a fresh client connection each, http.client).
    assert deployment.request("POST", "/v1/models/picky/predict", b"{not json")[2]["error"]["field"] == "body"


def test_a_body_over_the_limit_is_refused_before_it_is_sent(deployment):
    conn = Conn(deployment)
    try:
        conn.send(b"POST /v1/models/slow/predict HTTP/1.1\r\nHost: t\r\nContent-Length: 10000000\r\n\r\n")
        status, headers, body = conn.response()  # no body was sent: the answer cannot have waited for it
        assert status == 413 and json.loads(body)["error"]["type"] == "payload_too_large"
        assert headers["connection"] == "close" and conn.closed_by_server()
    finally:
        conn.close()


def test_a_body_over_the_limit_that_is_sent_anyway_still_gets_its_413(deployment):
    conn = Conn(deployment)  # the server drops the rest of the body rather than reset the connection under it
    try:
        conn.send(predict("slow", b'{"big": "%s"}' % (b"x" * 300_000)))
        status, headers, body = conn.response()
        assert status == 413 and json.loads(body)["error"]["type"] == "payload_too_large"
        assert headers["connection"] == "close" and conn.closed_by_server()
    finally:
        conn.close()


def test_chunked_bodies_expect_continue_and_http10(deployment):
    conn = Conn(deployment)
    try:
        conn.send(
            b"POST /v1/models/slow/predict HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
            b'4\r\n{"a"\r\n3\r\n: 1\r\n1\r\n}\r\n0\r\n\r\n'
        )
        status, _, body = conn.response()
        assert status == 200 and json.loads(body)["echo"] == {"a": 1}
        conn.send(b"POST /v1/models/slow/predict HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
        conn.send(b"%x\r\n%s\r\n" % (5000, b"x" * 5000))  # past max_body_bytes (4096) with no length up front
        status, _, body = conn.response()
        assert status == 413 and conn.closed_by_server()
    finally:
        conn.close()
    conn = Conn(deployment)
    try:
        conn.send(predict("slow", b"", b"Expect: 100-continue\r\n").replace(b"Content-Length: 0", b"Content-Length: 7"))
        assert conn.response()[0] == 100  # the client may send the body now
        conn.send(b'{"b":2}')
        status, _, body = conn.response()
        assert status == 200 and json.loads(body)["echo"] == {"b": 2}
    finally:
        conn.close()
    conn = Conn(deployment)
    try:
        http10 = predict("slow", b'{"c": 3}').replace(b"HTTP/1.1", b"HTTP/1.0")
        conn.send(http10.replace(b"Host: t\r\n", b"Host: t\r\nConnection: keep-alive\r\n"))
        status, headers, _ = conn.response()
        assert status == 200 and headers["connection"] == "keep-alive"  # HTTP/1.0 keeps alive only when told
        conn.send(http10)
        status, headers, _ = conn.response()
        assert status == 200 and headers["connection"] == "close" and conn.closed_by_server()
    finally:
        conn.close()


def test_malformed_http_is_a_json_400_and_the_connection_closes(deployment):
    conn = Conn(deployment)
    try:
        conn.send(predict("slow", b'{"d": 4}') + b"POST /v1/models/slow/predict HTTP/1.1\r\nContent-Length: x\r\n\r\n")
        status, _, body = conn.response()  # the request before it is answered first
        assert status == 200 and json.loads(body)["echo"] == {"d": 4}
        status, _headers, body = conn.response()
        assert status == 400 and json.loads(body)["error"]["type"] == "bad_request"
        assert conn.closed_by_server()
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("request_bytes", "status", "error_type"),
    [  # past gunicorn's defaults: a 4,094-byte request line, 100 header fields
        (b"POST /v1/models/slow/predict?q=" + b"x" * 5000 + b" HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}", 414,
         "uri_too_long"),
        (b"POST /v1/models/slow/predict HTTP/1.1\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(150))
         + b"Content-Length: 2\r\n\r\n{}", 431, "request_header_fields_too_large"),
    ],
)  # fmt: skip
def test_requests_past_the_http_limits_get_json_errors(deployment, request_bytes, status, error_type):
    conn = Conn(deployment)
    try:
        conn.send(request_bytes)
        got, headers, body = conn.response()
        assert got == status and json.loads(body)["error"]["type"] == error_type
        assert headers["server"] == "zserve" and conn.closed_by_server()
    finally:
        conn.close()


def test_an_idle_keep_alive_connection_is_closed_after_the_keep_alive_time(deployment):
    conn = Conn(deployment)
    try:
        conn.send(predict("slow", b"{}"))
        assert conn.response()[0] == 200
        started = time.monotonic()
        assert conn.closed_by_server()  # gunicorn's --keep-alive 5, as the supervisor starts it
        assert 4.0 < time.monotonic() - started < 8.0
    finally:
        conn.close()

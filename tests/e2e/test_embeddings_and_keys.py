"""OpenAI's /v1/embeddings and API keys, through `zserve up` and gunicorn, with the real `openai` client:
the same vectors as the native route (floats and base64), OpenAI-shaped errors, 401 without the right key
in each route's shape, the health routes open, a key file reloaded on SIGHUP, keys never in the logs."""

from __future__ import annotations

import base64
import os
import re
import signal
import time

import numpy as np
import openai
import psutil
import pytest
from deployment import Deployment, free_port, write_config

FILE_KEY = "zs-file-key-0123456789"
ENV_KEY = "zs-env-key-9876543210"
NEW_KEY = "zs-rotated-key-5555"

CONFIG = """
[frontends]
workers = 2
port = {port}
api_keys_file = "{keys_file}"

[[models]]
name = "echo"
handler = "zserve.models.echo:Echo"

[[models]]
name = "minilm"
handler = "zserve.models.embedding:SentenceEmbedding"
max_batch_size = 32
credits = 1
preprocess_workers = 1
"""

SENTENCES = ["hello world", "zserve batches small requests", "Größe und Übung", ""]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keys")
    keys_file = tmp / "api_keys"
    keys_file.write_text(f"# the frontends' keys\n\n{FILE_KEY}\n")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("ZSERVE_API_KEYS", f" {ENV_KEY} ,")
        d = Deployment(write_config(tmp, CONFIG.format(port=free_port(), keys_file=keys_file)))
    d.keys_file = keys_file
    yield d.wait_ready()
    assert d.stop() == 0, d.output
    for key in (FILE_KEY, ENV_KEY, NEW_KEY):
        assert key not in d.output  # keys never logged


def _auth(key: str) -> dict[str, str]:
    return {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}


def _oai(d: Deployment, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key=key, max_retries=0, timeout=60)


def _native(d: Deployment, text: str, key: str = FILE_KEY) -> np.ndarray:
    status, _, body = d.request("POST", "/v1/models/minilm/predict", {"text": text}, _auth(key))
    assert status == 200, body
    return np.array(body["embedding"], dtype=np.float32)


def test_openai_client_embeddings_match_the_native_route(deployment):
    d = deployment
    native = np.stack([_native(d, s) for s in SENTENCES])
    oai = _oai(d, ENV_KEY)
    out = oai.embeddings.create(model="minilm", input=SENTENCES)  # the client asks for base64 by default
    assert out.model == "minilm" and [e.index for e in out.data] == [0, 1, 2, 3]
    np.testing.assert_allclose(np.array([e.embedding for e in out.data]), native, atol=1e-5)
    floats = oai.embeddings.create(model="minilm", input=SENTENCES, encoding_format="float")
    np.testing.assert_allclose(np.array([e.embedding for e in floats.data]), native, atol=1e-5)
    # [CLS] hello world [SEP] = 4; each input's tokens, special ones included
    single = oai.embeddings.create(model="minilm", input="hello world", encoding_format="float")
    assert single.usage.prompt_tokens == single.usage.total_tokens == 4
    assert floats.usage.prompt_tokens > 4 * 2


def test_base64_is_little_endian_float32_of_the_same_vector(deployment):
    d = deployment
    body = {"model": "minilm", "input": "hello world", "encoding_format": "base64"}
    status, _, out = d.request("POST", "/v1/embeddings", body, _auth(FILE_KEY))
    assert status == 200 and out["object"] == "list" and out["data"][0]["object"] == "embedding"
    vector = np.frombuffer(base64.b64decode(out["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vector, _native(d, "hello world"), atol=1e-5)
    status, _, out = d.request("POST", "/v1/embeddings", {**body, "encoding_format": "float"}, _auth(FILE_KEY))
    np.testing.assert_array_equal(np.array(out["data"][0]["embedding"], dtype="<f4"), vector)


def test_the_inputs_of_one_call_are_batched_by_the_broker(deployment):
    d = deployment
    _, _, before = d.request("GET", "/metrics")
    _oai(d, FILE_KEY).embeddings.create(model="minilm", input=[f"sentence {i}" for i in range(24)])
    _, _, after = d.request("GET", "/metrics")

    def sums(text):
        count = float(re.search(r'zserve_batch_size_count\{model="minilm"\} (\S+)', text).group(1))
        total = float(re.search(r'zserve_batch_size_sum\{model="minilm"\} (\S+)', text).group(1))
        return count, total

    (c0, t0), (c1, t1) = sums(before), sums(after)
    assert c1 - c0 == 24 and (t1 - t0) / 24 > 2  # 24 requests, computed in batches, not one by one


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "echo", "input": "x"}, 404, "model"),
        ({"model": "nope", "input": "x"}, 404, "model"),
        ({"input": "x"}, 400, "model"),
        ({"model": "minilm", "input": []}, 400, "input"),
        ({"model": "minilm", "input": [101, "x"]}, 400, "input"),
        ({"model": "minilm", "input": [[101, 102], []]}, 400, "input"),
        ({"model": "minilm", "input": [101, -1]}, 400, "input"),
        ({"model": "minilm", "input": [[101, 30522]]}, 400, "input"),  # past the vocabulary
        ({"model": "minilm", "input": "x", "encoding_format": "hex"}, 400, "encoding_format"),
        ({"model": "minilm", "input": "x", "dimensions": 385}, 400, "dimensions"),
        ({"model": "minilm", "input": "x", "dimensions": 0}, 400, "dimensions"),
        ({"model": "minilm", "input": "x", "prompt_name": "nope"}, 400, "prompt_name"),
        ({"model": "minilm", "input": ["ok", "word " * 300], "truncate": False}, 400, "input"),
        ({"model": "minilm", "input": ["ok", "x" * 100_001]}, 400, "input"),
    ],
)
def test_embedding_errors_come_in_openai_shape(deployment, body, status, param):
    got, _, out = deployment.request("POST", "/v1/embeddings", body, _auth(FILE_KEY))
    assert got == status, out
    assert set(out["error"]) == {"message", "type", "param", "code"} and out["error"]["param"] == param
    assert out["error"]["type"] == "invalid_request_error"


def test_without_the_right_key_every_api_route_is_401_in_its_shape(deployment):
    d = deployment
    with pytest.raises(openai.AuthenticationError) as info:
        _oai(d, "wrong-key").embeddings.create(model="minilm", input="x")
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    assert info.value.response.headers["www-authenticate"] == "Bearer"
    for headers in ({"Content-Type": "application/json"}, _auth("wrong"), {"Authorization": f"Basic {FILE_KEY}"}):
        status, got, out = d.request("POST", "/v1/models/echo/predict", {"x": 1}, headers)
        assert status == 401 and got["www-authenticate"] == "Bearer"
        assert out["error"]["type"] == "invalid_api_key" and "param" not in out["error"]  # the native shape
        status, _, out = d.request("GET", "/v1/models", None, headers)
        assert status == 401
    status, _, out = d.request("GET", "/v1/models", None, _auth(ENV_KEY))
    assert status == 200 and {m["id"] for m in out["data"]} == {"echo", "minilm"}
    assert _oai(d, FILE_KEY).models.list().data[0].id == "echo"


def test_health_routes_are_open_by_default(deployment):
    for path in ("/healthz", "/readyz", "/metrics"):
        assert deployment.request("GET", path, None, {})[0] == 200, path


def _gunicorn_workers(d: Deployment) -> list[int]:
    masters = []
    for p in d.descendants():
        try:  # during a reload, processes come and go between listing and asking
            if p.ppid() == d.proc.pid and p.cmdline()[1:3] == ["-m", "gunicorn"]:
                masters.append(p)
        except psutil.NoSuchProcess:
            continue
    [master] = masters
    return [p.pid for p in master.children()]


def test_the_key_file_is_reloaded_on_sighup_in_each_worker(deployment):
    d = deployment
    d.keys_file.write_text(f"# rotated\n{NEW_KEY}\n")
    workers = _gunicorn_workers(d)
    assert len(workers) == 2
    seen = d.output.count("reloaded: 1 keys")
    for pid in workers:
        os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + 30
    while d.output.count("reloaded: 1 keys") < seen + 2:  # each worker logs its reload
        assert time.monotonic() < deadline, d.output[-3000:]
        time.sleep(0.05)
    assert _gunicorn_workers(d) == workers  # reloaded in place, not restarted
    for _ in range(8):  # both workers (connections land on either)
        assert d.request("POST", "/v1/models/echo/predict", {"x": 1}, _auth(NEW_KEY))[0] == 200
        assert d.request("POST", "/v1/models/echo/predict", {"x": 1}, _auth(FILE_KEY))[0] == 401
        assert d.request("POST", "/v1/models/echo/predict", {"x": 1}, _auth(ENV_KEY))[0] == 200
    assert _oai(d, NEW_KEY).embeddings.create(model="minilm", input="rotated").data[0].index == 0


def test_sighup_to_the_gunicorn_master_replaces_the_workers_which_read_the_file(deployment):
    d = deployment
    d.keys_file.write_text(f"{FILE_KEY}\n")
    [master] = [p for p in d.descendants() if p.ppid() == d.proc.pid and "gunicorn" in p.cmdline()]
    old_workers = set(_gunicorn_workers(d))
    seen = d.output.count("frontend worker up")
    master.send_signal(signal.SIGHUP)  # gunicorn's own reload: new workers, the old ones stop gracefully
    deadline = time.monotonic() + 60
    while d.output.count("frontend worker up") < seen + 2 or set(_gunicorn_workers(d)) & old_workers:
        assert time.monotonic() < deadline, d.output[-3000:]
        time.sleep(0.05)
    for _ in range(8):
        assert d.request("POST", "/v1/models/echo/predict", {"x": 1}, _auth(FILE_KEY))[0] == 200
        assert d.request("POST", "/v1/models/echo/predict", {"x": 1}, _auth(NEW_KEY))[0] == 401

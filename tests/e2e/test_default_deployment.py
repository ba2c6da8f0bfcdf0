"""The deployment `make serve` runs (supervisor.toml at the repo root), on a free port."""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest
from deployment import Deployment, free_port
from sentence_transformers import SentenceTransformer

import zserve
from zserve.models.embedding import bundled_minilm_path

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def default_deployment():
    d = Deployment(REPO / "supervisor.toml", "--port", str(free_port())).wait_ready(timeout_s=300)
    yield d
    assert d.stop() == 0, d.output


def test_echo_and_embeddings_over_http_and_the_direct_client(default_deployment):
    d = default_deployment
    status, _, body = d.request("POST", "/v1/models/echo/predict", {"hello": ["world", 1]})
    assert status == 200 and body == {"hello": ["world", 1]}

    status, headers, body = d.request("POST", "/v1/models/minilm/predict", {"text": "hello world"})
    assert status == 200 and int(headers["x-zserve-batch-size"]) >= 1
    # The library itself, as a user would call it on the same weights: whichever versions are installed
    # (`make test-newest` runs this file at the newest the ranges admit), the served vector is the library's.
    expected = SentenceTransformer(bundled_minilm_path(), device="cpu").encode(["hello world"])[0]
    np.testing.assert_allclose(np.array(body["embedding"]), expected, atol=1e-5)

    with zserve.Client.from_config(REPO / "supervisor.toml") as client:
        assert client.predict("echo", {"direct": True}) == {"direct": True}
        direct = client.predict("minilm", {"text": "hello world"})
        np.testing.assert_allclose(np.array(direct["embedding"]), expected, atol=1e-5)
        with pytest.raises(zserve.BadRequest) as info:
            client.predict("minilm", {"text": 42})
        assert info.value.field == "text"


def test_the_embedding_model_tokenises_on_a_stage_and_metrics_show_both_sides(default_deployment):
    d = default_deployment
    status, _, ready = d.request("GET", "/readyz")
    assert status == 200 and ready["preprocess_workers"]["minilm"] >= 1
    # a burst in one message (the direct client coalesces it): the first batch goes to the idle engine, which
    # tokenises it itself; while it computes, the full batches behind it go through the stage
    with zserve.Client.from_config(REPO / "supervisor.toml") as client:
        futures = [client.submit("minilm", {"text": f"sentence {i}"}) for i in range(96)]
        assert all(len(f.result(timeout=120)["embedding"]) == 384 for f in futures)
        stage = next(m for m in client.health().models if m.name == "minilm").preprocess_busy_s
    assert stage > 0
    for _ in range(100):  # the frontends' health report is cached for a moment
        _, _, metrics = d.request("GET", "/metrics")
        busy = {role: re.search(rf'zserve_stage_busy_seconds_total\{{model="minilm",role="{role}"\}} (\S+)', metrics)
                for role in ("preprocess", "engine")}  # fmt: skip
        if all(m and float(m.group(1)) > 0 for m in busy.values()):
            break
        time.sleep(0.1)
    assert all(m and float(m.group(1)) > 0 for m in busy.values()), busy
    assert 'zserve_stage_queue_depth{model="minilm",role="engine"}' in metrics


def test_the_chat_model_answers_over_openai_routes_and_mii(default_deployment):
    import openai

    d = default_deployment
    oai = openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    chat = oai.chat.completions.create(model="smollm2", messages=question, max_tokens=12, temperature=0)
    assert "Paris" in chat.choices[0].message.content
    streamed = oai.chat.completions.create(
        model="smollm2", messages=question, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat.choices[0].message.content
    status, _, body = d.request("POST", "/mii/smollm2", {"prompts": ["Once upon a time"], "max_length": 24,
                                                         "ignore_eos": True})  # fmt: skip
    assert status == 200 and body[0]["prompt_length"] + body[0]["generated_length"] == 24
    models = {m["id"] for m in d.request("GET", "/v1/models")[2]["data"]}
    assert models == {"echo", "minilm", "smollm2"}
    metrics = d.request("GET", "/metrics")[2]
    assert 'zserve_running_sequences{model="smollm2"} 0.0' in metrics
    assert re.search(r'zserve_free_kv_blocks\{model="smollm2"\} [1-9]', metrics)

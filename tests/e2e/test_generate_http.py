"""Generation over HTTP through the whole deployment (supervisor, broker, engine, gunicorn): the real
``openai`` client against /v1/completions and /v1/chat/completions, DeepSpeed-MII's REST requests (curl)
against /mii/{deployment}, OpenAI-shaped errors, and a client that goes away mid-stream."""

from __future__ import annotations

import http.client
import json
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import openai
import pytest
from tinylm import build_tiny_lm

import zserve

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import mii_rest_client  # bench/ is not a package: put on sys.path above


@pytest.fixture(scope="module", params=["gunicorn", "granian"])
def served(request, tmp_path_factory):
    path = build_tiny_lm(tmp_path_factory.mktemp("tinylm"))
    options = {"path": str(path), "block_size": 8, "num_blocks": 256, "max_running": 8, "max_new_tokens": 16}
    client = zserve.serve("zserve.models.causal_lm:CausalLM", name="tiny", options=options, timeout_ms=120_000,
                          server=request.param)  # fmt: skip
    try:
        yield client
    finally:
        assert client.terminate() == 0


@pytest.fixture(scope="module")
def oai(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_completions_with_the_openai_client_match_the_python_client(served, oai):
    [direct] = served.generate("DeepSpeed is", max_new_tokens=12, ignore_eos=True)
    out = oai.completions.create(model="tiny", prompt="DeepSpeed is", max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True})  # fmt: skip
    assert out.object == "text_completion" and out.model == "tiny"
    assert out.choices[0].text == direct.generated_text and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens == direct.prompt_length
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    two = oai.completions.create(model="tiny", prompt=["DeepSpeed is", "Seattle is"], max_tokens=5, temperature=0)
    assert [c.index for c in two.choices] == [0, 1] and two.choices[0].text == direct.generated_text[
        : len(two.choices[0].text)
    ]


def test_streamed_completion_concatenates_to_the_whole(served, oai):
    whole = oai.completions.create(model="tiny", prompt="Emoji travel as", max_tokens=30, temperature=0.8, seed=4,
                                   extra_body={"ignore_eos": True})  # fmt: skip
    events = list(oai.completions.create(model="tiny", prompt="Emoji travel as", max_tokens=30, temperature=0.8,
                                         seed=4, stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True}))  # fmt: skip
    text = "".join(e.choices[0].text for e in events if e.choices)
    assert len(events) > 3 and text == whole.choices[0].text
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "length"
    assert events[-1].usage.completion_tokens == 30


def test_chat_completions_streamed_and_not(served, oai):
    messages = [{"role": "user", "content": "hello there"}]
    chat = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True, "min_tokens": 10})  # fmt: skip
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 10
    stream = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})  # fmt: skip
    chunks = list(stream)
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content


def test_errors_come_in_openai_shape(oai):
    with pytest.raises(openai.NotFoundError) as info:
        oai.completions.create(model="nope", prompt="x")
    assert info.value.body["param"] == "model"
    cases = [
        ({"temperature": -1}, "temperature"),
        ({"n": 2}, "n"),
        ({"logprobs": 2}, "logprobs"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 100_000}, "max_new_tokens"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            oai.completions.create(model="tiny", prompt="x", extra_body=extra)
        assert info.value.body["param"] == param, extra
        assert info.value.body["type"] == "invalid_request_error"
    neutral = {"logprobs": False, "n": None, "top_logprobs": 0, "presence_penalty": 0}  # what wrappers send
    ok = oai.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body=neutral)
    assert ok.usage.completion_tokens <= 2
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="tiny", prompt=["a", "b"], stream=True)
    assert info.value.body["param"] == "prompt"  # one prompt per stream
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="tiny", messages=[])
    assert info.value.body["param"] == "messages"


def test_mii_rest_benchmark_requests_run_unchanged(served):
    """The REST part of DeepSpeed-MII's multi-process REST benchmark: one curl per prompt, at once."""
    url = f"{served.url}/mii/tiny"
    results = mii_rest_client.call_mii_rest_curl(url, mii_rest_client.QUERIES, max_length=40)
    assert len(results) == len(mii_rest_client.QUERIES)
    for [r] in results:
        assert r["generated_length"] == 40 - r["prompt_length"]  # max_length caps prompt + generated
        assert r["finish_reason"] == "length" and isinstance(r["generated_text"], str)
    [greedy] = mii_rest_client.parse_response(_post(url, {"prompts": ["DeepSpeed is"], "do_sample": False,
                                                          "max_new_tokens": 8, "ignore_eos": True}))  # fmt: skip
    [direct] = served.generate("DeepSpeed is", max_new_tokens=8, ignore_eos=True)
    assert greedy["generated_text"] == direct.generated_text
    status, body = _post_status(f"{served.url}/mii/tiny", {"prompt": "typo"})
    assert status == 400 and json.loads(body)["error"]["field"] == "prompts"
    status, body = _post_status(f"{served.url}/mii/nope", {"prompts": "x"})
    assert status == 404 and json.loads(body)["error"]["type"] == "model_not_found"


def test_client_gone_mid_stream_aborts_the_sequence(served):
    u = urlparse(served.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    body = {"model": "tiny", "prompt": "DeepSpeed is", "max_tokens": 400, "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    assert resp.readline().startswith(b"data: ")  # the first event is out
    seen_running = next(m for m in served.health().models if m.name == "tiny").running_sequences
    conn.sock.close()  # gone, mid-generation
    conn.close()
    deadline = time.monotonic() + 20
    while True:
        m = next(m for m in served.health().models if m.name == "tiny")
        if m.running_sequences == 0 and m.free_kv_blocks == 256:
            break
        assert time.monotonic() < deadline, "the abandoned sequence kept running"
        time.sleep(0.05)
    assert seen_running == 1


def _post_status(url: str, body: dict) -> tuple[int, bytes]:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", u.path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, resp.read()


def _post(url: str, body: dict) -> bytes:
    status, data = _post_status(url, body)
    assert status == 200, data
    return data

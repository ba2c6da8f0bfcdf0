"""Every [limits] check on every route that has it: the frontend's real falcon app (``create_app``) answers 400 naming
the field, before anything reaches the broker (there is none here: a request that passed the limits would hang
on its socket and fail the test by timeout, not pass it)."""

from __future__ import annotations

import falcon.testing
import pytest

from zserve.config import FrontendSettings, LimitsConfig, ServedModel
from zserve.frontends.app import create_app

LIMITS = LimitsConfig(max_inputs=4, max_stop=2, max_stop_chars=8, max_logit_bias=2, max_tools=1,
                      max_schema_bytes=2000, max_schema_depth=8, max_schema_properties=3)  # fmt: skip
WIDE = {"type": "object", "properties": {k: {"type": "integer"} for k in "abcd"}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
CHAT = {"model": "lm", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> falcon.testing.TestClient:
    run = tmp_path_factory.mktemp("no-broker")
    settings = FrontendSettings(
        client_endpoint=f"ipc://{run}/client.sock",
        models=[
            ServedModel(
                name="lm", handler="zserve.models.causal_lm:CausalLM", options={"path": str(run)}, max_inputs=4
            ),
            ServedModel(name="dictlm", handler="testmodels:DictLM", options={"path": str(run)}),
        ],
        limits=LIMITS,
    )
    return falcon.testing.TestClient(create_app(settings))


CASES = [
    ("/v1/completions", {"model": "lm", "prompt": ["a"] * 5}, "prompt"),
    ("/v1/completions", {"model": "lm", "prompt": ["a", "b"], "n": 3}, "prompt"),
    ("/v1/completions", {"model": "lm", "prompt": "a", "n": 5}, "n"),
    ("/v1/completions", {"model": "lm", "prompt": "a", "stop": ["x", "y", "z"]}, "stop"),
    ("/v1/completions", {"model": "lm", "prompt": "a", "stop": "a stop string too long"}, "stop"),
    ("/v1/completions", {"model": "lm", "prompt": "a", "logit_bias": {"1": 1, "2": 1, "3": 1}}, "logit_bias"),
    ("/v1/completions", {"model": "lm", "prompt": "a", "guided_json": WIDE}, "guided_json"),
    ("/v1/chat/completions", {**CHAT, "n": 5}, "n"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL, TOOL]}, "tools"),
    ("/tokenize", {**CHAT, "tools": [TOOL, TOOL]}, "tools"),
    (
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": WIDE}}},
        "response_format",
    ),
    ("/v1/chat/completions", {**CHAT, "stop": ["1", "2", "3"]}, "stop"),
    ("/mii/lm", {"prompts": ["a"] * 5}, "prompts"),
    ("/mii/lm", {"prompts": "a", "stop": ["x", "y", "z"]}, "stop"),
    ("/v1/models/lm/predict", {"prompt": "a", "stop": ["x", "y", "z"]}, "stop"),
    ("/v1/models/lm/predict", {"prompt": "a", "logit_bias": {"1": 1, "2": 1, "3": 1}}, "logit_bias"),
    (
        "/v1/models/lm/predict",
        {"prompt": "a", "json_schema": '{"type": "object", "properties": {"a": {}, "b": {}, "c": {}, "d": {}}}'},
        "json_schema",
    ),
]


@pytest.mark.parametrize(("path", "body", "field"), CASES, ids=[f"{p} {f}" for p, _, f in CASES])
def test_past_a_limit_is_a_400_naming_the_field(client, path, body, field):
    resp = client.simulate_post(path, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json["error"]
    assert (error.get("param") or error.get("field")) == field, error
    assert "[limits]" in error["message"], error


def test_mii_takes_null_for_an_unknown_field_and_refuses_a_value(client):
    """MII clients send every field, nulls included: null is the default, known to zserve or not (the request then
    meets its limit here, past the unknown-field check); an unknown field with a value is refused naming it."""
    resp = client.simulate_post("/mii/lm", json={"prompts": ["a"] * 5, "num_beams": None})
    assert resp.status_code == 400 and resp.json["error"]["field"] == "prompts", resp.text
    resp = client.simulate_post("/mii/lm", json={"prompts": ["a"] * 5, "num_beams": 2})
    assert resp.status_code == 400 and resp.json["error"]["field"] == "num_beams", resp.text


def test_a_generative_model_returning_a_dict_is_held_to_the_limits_too(client):
    """decode_request of the contract before 2026-12-07 returns a GenerateRequest-shaped dict: still within [limits]."""
    resp = client.simulate_post("/v1/models/dictlm/predict", json={"prompt": "a", "stop": ["x", "y", "z"]})
    assert resp.status_code == 400 and resp.json["error"]["field"] == "stop", resp.text


def test_a_tokenizer_that_does_not_load_is_a_500_naming_why(client):
    """This app's models have no tokenizer in their folder: /tokenize and /detokenize answer a server error in
    OpenAI's shape that says why, after a bad body's own 400 and an unknown model's 404."""
    for path, body in (("/tokenize", {"model": "lm", "prompt": "hi"}), ("/detokenize", {"model": "lm", "tokens": [1]})):
        resp = client.simulate_post(path, json=body)
        assert resp.status_code == 500, resp.text
        error = resp.json["error"]
        assert (error["type"], error["code"]) == ("server_error", "tokenizer_unavailable"), error
        assert "does not load" in error["message"], error
    resp = client.simulate_post("/tokenize", json={"model": "lm", "prompt": "hi", "chat_template_kwargs": {"a": 1}})
    assert resp.status_code == 400 and resp.json["error"]["param"] == "chat_template_kwargs", resp.text
    resp = client.simulate_post("/tokenize", json={"prompt": "hi"})  # two generative models: which one?
    assert resp.status_code == 400 and resp.json["error"]["param"] == "model", resp.text
    resp = client.simulate_post("/detokenize", json={"model": "nope", "tokens": [1]})
    assert resp.status_code == 404 and resp.json["error"]["param"] == "model", resp.text

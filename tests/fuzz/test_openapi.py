"""/openapi.json against a live deployment (conftest.py's, shared with test_http_fuzz.py: an echo, an embedding, a
rerank and a generative model, API keys with `auth_health`): it validates as OpenAPI 3.1, covers every route, and a
bounded schemathesis run finds no 5xx and no answer outside the documented status codes, content types and
schemas."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from openapi_spec_validator import validate

from .conftest import AUTH, KEY

# schemathesis's whole-run budget: its examples and coverage phases run in full, then fuzzing repeats until it
# is spent, so CI's short budget fuzzes less and skips nothing
FUZZ_S = "120" if os.environ.get("ZSERVE_SLOW") == "1" else "15"


def _auth() -> dict[str, str]:
    return dict(AUTH)


def test_the_document_is_openapi_3_1_and_covers_every_route(deployment):
    status, _, doc = deployment.request("GET", "/openapi.json", None, _auth())
    assert status == 200
    validate(doc)  # raises on any violation of the OpenAPI 3.1 schema
    assert doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) == {
        "/v1/models/{name}/predict", "/v1/models", "/healthz", "/readyz", "/metrics", "/openapi.json",
        "/v1/completions", "/v1/chat/completions", "/mii/{deployment}", "/v1/embeddings", "/v1/rerank", "/v2/rerank",
        "/v1/score", "/tokenize", "/detokenize",
    }  # fmt: skip
    schemas = doc["components"]["schemas"]
    assert {"Error", "OpenAIError", "EmbeddingRequest", "CompletionRequest", "GenerateResponse"} <= set(schemas)
    completions = doc["paths"]["/v1/completions"]["post"]
    assert completions["responses"]["401"]["content"]["application/json"]["schema"]["$ref"].endswith("/OpenAIError")
    assert completions["security"] == [{"bearer": []}]
    assert doc["paths"]["/healthz"]["get"]["security"] == [{"bearer": []}]  # auth_health = true
    predict = doc["paths"]["/v1/models/{name}/predict"]["post"]
    assert predict["parameters"][0]["schema"]["enum"] == ["echo", "minilm", "rerank", "tiny"]
    assert deployment.request("GET", "/openapi.json", None, {})[0] == 401
    assert deployment.request("GET", "/healthz", None, {})[0] == 401


def test_schemathesis_finds_no_server_error_and_no_undocumented_answer(deployment, tmp_path):
    # One worker: hypothesis parses lambdas' source with ast, which CPython 3.11 does not do safely from two
    # threads at once ("AST constructor recursion depth mismatch", a runtime error in the run, not a finding).
    run = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "--no-color", "run", f"{deployment.url}/openapi.json",
         "--header", f"Authorization: Bearer {KEY}",
         "--checks", "not_a_server_error,status_code_conformance,content_type_conformance,"
                     "response_schema_conformance,response_headers_conformance",
         "--phases", "examples,coverage,fuzzing", "--max-examples", "15", "--max-time", FUZZ_S,
         "--generation-deterministic", "--request-timeout", "60", "--workers", "1",
         "--continue-on-failure"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path, env={**os.environ, "NO_COLOR": "1"},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-3000:]
    assert "No issues found" in run.stdout or "passed" in run.stdout, run.stdout[-5000:]


def test_a_stream_refused_before_any_text_is_an_http_error_not_an_event(deployment):
    body = {"model": "tiny", "prompt": "", "stream": True}  # what schemathesis found answered 200 + an error event
    status, headers, out = deployment.request("POST", "/v1/completions", body, _auth())
    assert status == 400 and headers["content-type"].startswith("application/json")
    assert out["error"]["param"] == "prompt" and out["error"]["type"] == "invalid_request_error"


def test_an_integer_past_64_bits_is_a_400_not_a_500(deployment):
    status, _, out = deployment.request("POST", "/v1/models/echo/predict", '{"x": 123456789012345678901234567890}',
                                        _auth())  # fmt: skip
    assert status == 400 and out["error"]["field"] == "body"


def test_the_supervisors_probe_key_opens_the_health_routes_only(deployment):
    [master] = [p for p in deployment.descendants() if p.ppid() == deployment.proc.pid and "gunicorn" in p.cmdline()]
    probe_key = json.loads(master.environ()["ZSERVE_FRONTEND"])["probe_key"]
    probe = {"Authorization": f"Bearer {probe_key}"}
    assert len(probe_key) > 30 and probe_key not in deployment.output
    assert deployment.request("GET", "/readyz", None, probe)[0] == 200
    assert deployment.request("GET", "/v1/models", None, probe)[0] == 401

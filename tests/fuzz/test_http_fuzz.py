"""Fuzzed HTTP bodies against a live deployment (``zserve up``, gunicorn; conftest.py's, with an API key): every
route (native predict, /v1/completions, /v1/chat/completions, /v1/embeddings, /v1/rerank, /v2/rerank, /v1/score,
/tokenize, /detokenize, /mii/...) answers anything a client can send with a 2xx or a 4xx whose body is a JSON
error in the route's shape, never a 5xx, and keeps serving."""

from __future__ import annotations

import http.client
import json

import pytest
from deployment import Deployment
from fuzzing import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from .conftest import AUTH

# routes whose errors come in OpenAI's shape ({"error": {"message", "type", "param", "code"}})
OPENAI_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/rerank", "/v2/rerank", "/v1/score",
                 "/tokenize", "/detokenize")  # fmt: skip
ROUTES = ("/v1/models/echo/predict", "/mii/tiny", *OPENAI_ROUTES)
counted: dict[str, int] = {}
served: dict[str, int] = {}  # of those, answered 2xx (the strategies reach the models, not only the validation)


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    print("\nHTTP fuzz cases per test:", counted, "\nof those 2xx:", served)


def post(d: Deployment, path: str, body: bytes, content_type: str = "application/json") -> tuple[int, str, bytes]:
    host, port = d.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, body=body, headers={**AUTH, "Content-Type": content_type})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type", ""), resp.read()
    finally:
        conn.close()


def check(d: Deployment, path: str, body: bytes, test: str, content_type: str = "application/json") -> int:
    """POST ``body``; assert no 5xx and, for an error, a JSON error body in the route's shape."""
    counted[test] = counted.get(test, 0) + 1
    status, ctype, data = post(d, path, body, content_type)
    assert status < 500, (path, body[:300], status, data[:500])
    served[test] = served.get(test, 0) + (status < 300)
    if status >= 400:
        error = json.loads(data)["error"]
        assert error["message"], data
        assert ("code" in error and "param" in error) if path in OPENAI_ROUTES else "type" in error, data
    elif "event-stream" not in ctype:
        json.loads(data)
    return status


json_scalars = (
    st.none() | st.booleans() | st.integers() | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20)
)  # fmt: skip
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
small_ints = st.integers(min_value=-3, max_value=12)
sampling = {
    "max_tokens": small_ints | json_values,
    "max_completion_tokens": small_ints,
    "temperature": st.floats(-1, 3) | json_values,
    "top_p": st.floats(-0.5, 1.5),
    "top_k": small_ints,
    "seed": st.integers() | json_values,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3) | json_values,
    "stop_token_ids": st.lists(st.integers(-5, 500), max_size=3) | json_values,
    "ignore_eos": st.booleans() | json_values,
    "min_tokens": small_ints,
    "n": st.integers(0, 3),
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
    "logprobs": st.none() | st.booleans() | st.integers(0, 3),
    "echo": st.booleans(),
    "user": st.text(max_size=8),
}
model_names = st.sampled_from(["tiny", "echo", "minilm", "rerank", "nope", ""]) | json_values
prompts = st.text(max_size=40) | st.lists(st.text(max_size=20), max_size=3) | json_values
messages = (
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]) | json_values,
                                    "content": st.text(max_size=30) | json_values}), max_size=3)
    | json_values
)  # fmt: skip


texts = st.text(max_size=30) | json_values
documents = (
    st.lists(st.text(max_size=30), max_size=4)
    | st.lists(st.fixed_dictionaries({"text": texts}) | texts, max_size=3)
    | json_values
)
rerank_fields = {
    "query": texts,
    "documents": documents,
    "top_n": small_ints | json_values,
    "return_documents": st.booleans() | json_values,
    "truncate_prompt_tokens": small_ints | json_values,
}


def bodies(fixed: dict, optional: dict) -> st.SearchStrategy:
    return st.fixed_dictionaries(fixed, optional=optional).map(lambda b: json.dumps(b).encode())


# Well-formed requests with fuzzed values, so that a share of the cases reaches the model and its
# response encoding, not only the validation.
words = st.text(min_size=1, max_size=30)
some_words = st.lists(words, min_size=1, max_size=4)
light_sampling = {
    "max_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(0, 20),
    "seed": st.integers(0, 2**31),
    "stop": st.text(min_size=1, max_size=3),
    "stream": st.booleans(),
}
user_messages = st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": words}), min_size=1, max_size=3)
SERVABLE = {
    "/v1/completions": bodies({"model": st.just("tiny"), "prompt": words}, light_sampling),
    "/v1/chat/completions": bodies({"model": st.just("tiny"), "messages": user_messages}, light_sampling),
    "/v1/embeddings": bodies({"model": st.just("minilm"), "input": words | some_words}, {}),
    "/v1/rerank": bodies(
        {"model": st.just("rerank"), "query": words, "documents": some_words}, {"top_n": st.integers(1, 5)}
    ),
    "/v1/score": bodies({"model": st.just("rerank"), "text_1": words, "text_2": words | some_words}, {}),
}
SERVABLE["/v2/rerank"] = SERVABLE["/v1/rerank"]
SERVABLE["/tokenize"] = bodies(
    {"prompt": words}, {"model": st.just("tiny"), "return_token_strs": st.booleans()}
) | bodies({"messages": user_messages}, {"add_generation_prompt": st.booleans(), "add_special_tokens": st.booleans()})
SERVABLE["/detokenize"] = bodies({"tokens": st.lists(st.integers(0, 100), max_size=10)}, {"model": st.just("tiny")})

FUZZED = {
    "/v1/models/echo/predict": json_values.map(lambda v: json.dumps(v).encode()),
    "/v1/completions": bodies({"model": model_names}, {"prompt": prompts, **sampling}),
    "/v1/chat/completions": bodies({"model": model_names}, {"messages": messages, **sampling}),
    "/v1/embeddings": bodies(
        {"model": model_names},
        {
            "input": prompts,
            "encoding_format": st.sampled_from(["float", "base64", "hex"]) | json_values,
            "dimensions": st.none() | st.integers(0, 500),
            "user": st.text(max_size=5),
        },
    ),
    "/v1/rerank": bodies({"model": model_names}, rerank_fields),
    "/v2/rerank": bodies({"model": model_names}, rerank_fields),
    "/v1/score": bodies(
        {"model": model_names},
        {"text_1": texts | st.lists(st.text(max_size=20), max_size=3), "text_2": texts | documents},
    ),
    "/tokenize": bodies(
        {},
        {
            "model": model_names | st.none(),
            "prompt": prompts,
            "messages": messages,
            "tools": json_values,
            "add_generation_prompt": st.booleans() | json_values,
            "add_special_tokens": st.booleans() | json_values,
            "return_token_strs": st.booleans() | json_values,
        },
    ),
    "/detokenize": bodies(
        {}, {"model": model_names, "tokens": st.lists(st.integers(-2, 2**40), max_size=5) | json_values}
    ),
    "/mii/tiny": bodies(
        {"prompts": prompts},
        {
            "max_new_tokens": small_ints | json_values,
            "max_length": st.integers(-2, 64),
            "do_sample": st.booleans(),
            "temperature": st.floats(-1, 3),
            "top_k": small_ints,
            "top_p": st.floats(-0.5, 1.5),
            "stop": st.text(max_size=3) | json_values,
            "return_full_text": st.booleans(),
            "stream": st.booleans(),
        },
    ),
}
ROUTE_BODIES = {path: SERVABLE[path] | body if path in SERVABLE else body for path, body in FUZZED.items()}


def mangled(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Valid-looking bodies broken at the byte level: truncated, a byte replaced, or random bytes."""
    cut = st.tuples(valid, st.integers(0, 10_000)).map(lambda t: t[0][: t[1] % (len(t[0]) + 1)])
    flipped = st.tuples(valid, st.integers(0, 10_000), st.integers(0, 255)).map(
        lambda t: t[0][: t[1] % (len(t[0]) + 1)] + bytes([t[2]]) + t[0][t[1] % (len(t[0]) + 1) + 1 :]
    )
    return cut | flipped | st.binary(max_size=200)


@pytest.mark.parametrize("path", ROUTES)
def test_fuzzed_json_bodies_are_never_a_server_error(deployment, path):
    @fuzz_settings(60)
    @given(body=ROUTE_BODIES[path])
    def fuzz(body):
        check(deployment, path, body, f"json {path}")

    fuzz()
    assert served[f"json {path}"] > 0  # some cases were served, not all refused


@pytest.mark.parametrize("path", ROUTES)
def test_fuzzed_bytes_and_content_types_are_never_a_server_error(deployment, path):
    @fuzz_settings(40)
    @given(body=mangled(ROUTE_BODIES[path]), content_type=st.sampled_from(["application/json", "text/plain", ""]))
    def fuzz(body, content_type):
        status = check(deployment, path, body, f"bytes {path}", content_type)
        assert status != 200 or body.strip()  # an empty body is never a success

    fuzz()


DEEP = 5000


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize(
    "body",
    ['{"a":' * DEEP + "1" + "}" * DEEP, "[" * DEEP + "]" * DEEP, '{"a":' * DEEP, "[" * DEEP,
     '{"model": "tiny", "prompt": ' + "[" * 200 + "]" * 200 + ', "input": ' + "[" * 200 + "]" * 200 + "}"],
    ids=["object", "array", "truncated-object", "truncated-array", "deep-field"],
)  # fmt: skip
def test_deeply_nested_bodies_are_400_naming_body(deployment, path, body):
    status, _, data = post(deployment, path, body.encode())
    error = json.loads(data)["error"]
    assert status == 400, data[:300]
    assert (error["param"] if path in OPENAI_ROUTES else error["field"]) == "body", error


def test_nesting_within_the_limit_is_served(deployment):
    body = "[" * 100 + "1" + "]" * 100
    status, _, data = post(deployment, "/v1/models/echo/predict", body.encode())
    assert status == 200 and json.loads(data) == json.loads(body)

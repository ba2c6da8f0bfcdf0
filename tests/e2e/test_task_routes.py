"""The batch-task handlers end to end through `zserve up`, gunicorn and preprocess stages: classification,
reranking (/v1/rerank, /v2/rerank, /v1/score, batched by tokens) and image classification (raw bytes and
base64 over HTTP, bytes over the direct client), each answer equal to the handler run in this process,
and bad input answered 400 naming the field. Then `zserve serve FOLDER` with no config file."""

from __future__ import annotations

import base64
import http.client
import json

import numpy as np
import pytest
from deployment import Deployment, free_port, write_config
from tinymodels import image_file

import zserve
from zserve.config import parse_config
from zserve.model import predict_inline, setup_inline
from zserve.models.classification import SequenceClassification
from zserve.models.image_classification import ImageClassification
from zserve.models.rerank import CrossEncoderRerank

CONFIG = """
[frontends]
workers = 1
port = {port}

[[models]]
name = "sentiment"
handler = "zserve.models.classification:SequenceClassification"
preprocess_workers = 1
[models.options]
path = "{classifier}"

[[models]]
name = "rerank"
handler = "zserve.models.rerank:CrossEncoderRerank"
max_batch_cost = 2048
preprocess_workers = 1
[models.options]
path = "{reranker}"

[[models]]
name = "vit"
handler = "zserve.models.image_classification:ImageClassification"
max_batch_cost = 100000
preprocess_workers = 1
[models.options]
path = "{vit}"
top_k = 2
"""

QUERY = "what is the capital of france?"
DOCUMENTS = ["paris is the capital of france.", "the quick brown fox", "berlin is the capital of germany",
             "rerank the documents", "a terrible film"]  # fmt: skip


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, tiny_classifier, tiny_cross_encoder, tiny_vit):
    tmp = tmp_path_factory.mktemp("tasks")
    config = CONFIG.format(port=free_port(), classifier=tiny_classifier, reranker=tiny_cross_encoder, vit=tiny_vit)
    d = Deployment(write_config(tmp, config))
    yield d.wait_ready()
    assert d.stop() == 0, d.output


@pytest.fixture(scope="module")
def local(tiny_classifier, tiny_cross_encoder, tiny_vit):
    """The same handlers in this process: what every answer must equal."""
    models = {"sentiment": SequenceClassification(path=str(tiny_classifier)),
              "rerank": CrossEncoderRerank(path=str(tiny_cross_encoder)),
              "vit": ImageClassification(path=str(tiny_vit), top_k=2)}  # fmt: skip
    for model in models.values():
        setup_inline(model)
    return models


def _expected(local, name, body):
    model = local[name]
    return model.encode_response(predict_inline(model, [model.decode_request(body)])[0])


def _raw_post(url, path, data, content_type):
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, body=data, headers={"Content-Type": content_type})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_classification_over_http_and_the_direct_client(deployment, local):
    for body in ({"text": "the movie was wonderful"}, {"text": "berlin", "text_pair": "the capital of germany"}):
        status, _, out = deployment.request("POST", "/v1/models/sentiment/predict", body)
        assert status == 200, out
        expected = _expected(local, "sentiment", body)
        assert out["label"] == expected["label"] and [e["label"] for e in out["labels"]] == [
            e["label"] for e in expected["labels"]
        ]
        np.testing.assert_allclose([e["score"] for e in out["labels"]], [e["score"] for e in expected["labels"]],
                                   atol=1e-5)  # fmt: skip
    with zserve.Client.from_config(deployment.config_path) as client:
        out = client.predict("sentiment", {"text": "a terrible film"})
        assert out["label"] == _expected(local, "sentiment", {"text": "a terrible film"})["label"]
        with pytest.raises(zserve.BadRequest) as info:
            client.predict("sentiment", {"text": "x", "text_pair": 7})
        assert info.value.field == "text_pair"
    status, _, out = deployment.request("POST", "/v1/models/sentiment/predict", {"txt": "x"})
    assert status == 400 and out["error"]["field"] == "txt"


def test_rerank_orders_documents_by_the_cross_encoders_score(deployment, local):
    expected = [_expected(local, "rerank", {"query": QUERY, "document": d})["score"] for d in DOCUMENTS]
    order = list(np.argsort(-np.array(expected)))
    body = {"model": "rerank", "query": QUERY, "documents": DOCUMENTS}
    status, _, out = deployment.request("POST", "/v1/rerank", body)
    assert status == 200, out
    assert [r["index"] for r in out["results"]] == order
    np.testing.assert_allclose([r["relevance_score"] for r in out["results"]], np.array(expected)[order], atol=1e-5)
    assert [r["document"]["text"] for r in out["results"]] == [DOCUMENTS[i] for i in order]
    assert out["model"] == "rerank" and out["usage"]["total_tokens"] > len(DOCUMENTS) * 4 and out["id"]
    # Cohere's v2 path, documents as objects, top_n, no documents back.
    body = {"model": "rerank", "query": QUERY, "documents": [{"text": d} for d in DOCUMENTS], "top_n": 2,
            "return_documents": False}  # fmt: skip
    status, _, out = deployment.request("POST", "/v2/rerank", body)
    assert status == 200 and [r["index"] for r in out["results"]] == order[:2]
    assert all("document" not in r for r in out["results"])


def test_score_one_to_many_and_pairwise(deployment, local):
    status, _, out = deployment.request("POST", "/v1/score", {"model": "rerank", "text_1": QUERY, "text_2": DOCUMENTS})
    assert status == 200, out
    expected = [_expected(local, "rerank", {"query": QUERY, "document": d})["score"] for d in DOCUMENTS]
    assert [d["index"] for d in out["data"]] == list(range(len(DOCUMENTS))) and out["object"] == "list"
    np.testing.assert_allclose([d["score"] for d in out["data"]], expected, atol=1e-5)
    body = {"model": "rerank", "text_1": ["paris", "berlin"], "text_2": ["france", "germany"]}
    status, _, out = deployment.request("POST", "/v1/score", body)
    pairs = [("paris", "france"), ("berlin", "germany")]
    expected = [_expected(local, "rerank", {"query": q, "document": d})["score"] for q, d in pairs]
    assert status == 200 and len(out["data"]) == 2
    np.testing.assert_allclose([d["score"] for d in out["data"]], expected, atol=1e-5)
    assert out["usage"]["prompt_tokens"] == out["usage"]["total_tokens"] > 0


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [("/v1/rerank", {"model": "rerank", "documents": ["d"]}, 400, "query"),
     ("/v1/rerank", {"model": "rerank", "query": "q", "documents": []}, 400, "documents"),
     ("/v1/rerank", {"model": "rerank", "query": "q", "documents": ["d", 3]}, 400, "documents"),
     ("/v1/rerank", {"model": "rerank", "query": "q", "documents": ["d"], "top_n": 0}, 400, "top_n"),
     ("/v1/rerank", {"model": "sentiment", "query": "q", "documents": ["d"]}, 404, "model"),
     ("/v1/rerank", {"model": "rerank", "query": "q", "documents": ["x" * 100_001]}, 400, "documents"),
     ("/v1/score", {"model": "rerank", "text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, 400, "text_2"),
     ("/v1/score", {"model": "rerank", "text_2": "x"}, 400, "text_1")],
)  # fmt: skip
def test_rerank_and_score_bad_bodies_are_named_in_openais_shape(deployment, path, body, status, param):
    got, _, out = deployment.request("POST", path, body)
    assert got == status, out
    assert out["error"]["param"] == param and out["error"]["message"]


def test_images_as_raw_bytes_base64_and_over_the_direct_client(deployment, local):
    png, jpeg = image_file(48, 40, "PNG", seed=5), image_file(80, 60, "JPEG", seed=6)
    status, out = _raw_post(deployment.url, "/v1/models/vit/predict", png, "image/png")
    assert status == 200, out
    expected = _expected(local, "vit", png)
    assert [e["label"] for e in out["labels"]] == [e["label"] for e in expected["labels"]] and len(out["labels"]) == 2
    np.testing.assert_allclose([e["score"] for e in out["labels"]], [e["score"] for e in expected["labels"]], atol=1e-5)
    body = {"image": base64.b64encode(jpeg).decode()}
    status, _, out = deployment.request("POST", "/v1/models/vit/predict", body)
    assert status == 200 and out["label"] == _expected(local, "vit", jpeg)["label"]
    with zserve.Client.from_config(deployment.config_path) as client:
        assert client.predict("vit", png)["label"] == expected["label"]
        with pytest.raises(zserve.BadRequest) as info:
            client.predict("vit", b"not an image at all")
        assert info.value.field == "image"


def test_a_bad_image_is_a_400_naming_image_and_its_batch_mates_are_served(deployment):
    status, out = _raw_post(deployment.url, "/v1/models/vit/predict", b"\x89PNG but not really", "image/png")
    assert status == 400 and out["error"]["field"] == "image"
    status, _, out = deployment.request("POST", "/v1/models/vit/predict", {"image": "%%%"})
    assert status == 400 and out["error"]["field"] == "image"
    truncated = image_file(60, 60, "PNG", seed=7)[:300]  # passes the frontend's header check, fails decoding
    with zserve.Client.from_config(deployment.config_path) as client:
        futures = [client.submit("vit", image_file(30, 30, "PNG", seed=s)) for s in range(6)]
        futures.insert(3, client.submit("vit", truncated))
        results = [f.exception() or f.result() for f in futures]
    assert isinstance(results[3], zserve.BadRequest) and results[3].field == "image"
    assert all(isinstance(r, dict) and r["label"] for i, r in enumerate(results) if i != 3)
    status, out = _raw_post(deployment.url, "/v1/models/vit/predict", truncated, "application/octet-stream")
    assert status == 400 and out["error"]["field"] == "image"


def test_the_routes_are_listed_and_documented(deployment):
    status, _, doc = deployment.request("GET", "/openapi.json", None)
    assert status == 200 and {"/v1/rerank", "/v2/rerank", "/v1/score"} <= set(doc["paths"])
    assert doc["components"]["schemas"]["RerankRequest"]["properties"]["model"]["enum"] == ["rerank"]
    status, _, models = deployment.request("GET", "/v1/models", None)
    assert {m["id"] for m in models["data"]} == {"sentiment", "rerank", "vit"}


def test_zserve_serve_a_folder_without_a_config_file(tiny_classifier, tmp_path):
    port = free_port()
    d = Deployment(None, "--port", str(port), "--workers", "1", command=("serve", str(tiny_classifier)))
    try:
        d.wait_ready()
        status, _, out = d.request("POST", "/v1/models/classifier/predict", {"text": "the movie was wonderful"})
        assert status == 200 and out["label"] in ("negative", "neutral", "positive"), out
        status, _, ready = d.request("GET", "/readyz", None)
        assert status == 200 and ready["preprocess_workers"] == {"classifier": 1}  # tokenised on a stage
    finally:
        assert d.stop() == 0, d.output
    printed = Deployment(None, "--print-config", "--port", str(port), command=("serve", str(tiny_classifier)))
    assert printed.proc.wait(timeout=60) == 0, printed.output
    printed._reader.join(timeout=5)
    config = parse_config(printed.output)
    [model] = config.models
    assert model.handler == "zserve.models.classification:SequenceClassification" and config.frontends.port == port
    assert model.options["path"] == str(tiny_classifier.resolve()) and model.max_batch_cost > 0

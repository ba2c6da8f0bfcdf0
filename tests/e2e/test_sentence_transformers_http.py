"""sentence-transformers folders served end to end (`zserve up`, gunicorn, preprocess stages, engines): the vectors
of /v1/embeddings (the real openai client), of the native route and of the direct client equal
``SentenceTransformer.encode`` on the same folder, with the same prompt and ``truncate_dim``; a ``CrossEncoder``
folder's scores equal ``CrossEncoder.predict``; ``zserve serve FOLDER`` infers each task; a folder the library
cannot load stops the deployment at start with the library's message, without restarts."""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest
from deployment import Deployment, free_port, write_config
from st_stacks import PROMPTS, build_bert_encoder, build_llama_encoder, build_stack

import zserve

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "berlin is the capital of germany", "a"]
MODEL = """
[[models]]
name = "{name}"
handler = "zserve.models.embedding:SentenceEmbedding"
preprocess_workers = 1
max_batch_cost = 4096
[models.options]
path = "{path}"
"""


@pytest.fixture(scope="module")
def stacks(tmp_path_factory):
    root = tmp_path_factory.mktemp("stacks")
    bert, llama = build_bert_encoder(root / "bert"), build_llama_encoder(root / "llama")
    return {
        "cls-dense": build_stack(bert, root / "cls-dense", "cls", dense=24, normalize=True, truncate_dim=16),
        "lasttoken-prompts": build_stack(
            llama, root / "lasttoken", "lasttoken", normalize=True, prompts=PROMPTS, default_prompt_name="query"
        ),
        "mean-noprompt": build_stack(bert, root / "mean", "mean", prompts=PROMPTS, include_prompt=False),
    }


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, stacks, tiny_cross_encoder):
    from sentence_transformers import CrossEncoder

    cross_encoder = tmp_path_factory.mktemp("ce") / "ce"
    CrossEncoder(str(tiny_cross_encoder)).save(str(cross_encoder))  # a CrossEncoder folder, as the library saves it
    config = f"[frontends]\nworkers = 1\nport = {free_port()}\n"
    config += "".join(MODEL.format(name=name, path=path) for name, path in stacks.items())
    config += MODEL.format(name="ce", path=cross_encoder).replace(
        "embedding:SentenceEmbedding", "rerank:CrossEncoderRerank"
    )
    d = Deployment(write_config(tmp_path_factory.mktemp("st-http"), config))
    d.cross_encoder = cross_encoder
    yield d.wait_ready()
    assert d.stop() == 0, d.output


def _library(folder):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu")


@pytest.mark.parametrize("name", ["cls-dense", "lasttoken-prompts", "mean-noprompt"])
def test_http_and_the_direct_client_equal_the_library(deployment, stacks, name):
    library = _library(stacks[name])
    oai = openai.OpenAI(base_url=deployment.url + "/v1", api_key="none", max_retries=0, timeout=60)
    cases = [({}, {}), ({"prompt_name": "passage"}, {"prompt_name": "passage"}), ({"prompt": "X: "}, {"prompt": "X: "})]
    if name == "cls-dense":
        cases = cases[:1] + cases[2:]  # no prompts in this folder
    for extra, encode_kwargs in cases:
        reference = library.encode(TEXTS, **encode_kwargs)
        out = oai.embeddings.create(model=name, input=TEXTS, encoding_format="float", extra_body=extra)
        np.testing.assert_allclose(np.array([e.embedding for e in out.data]), reference, atol=1e-5)
        prompt = library._resolve_prompt(encode_kwargs.get("prompt"), encode_kwargs.get("prompt_name"))
        tokens = library.preprocess(TEXTS, prompt=prompt)["attention_mask"].sum().item()
        assert out.usage.prompt_tokens == tokens
        native = [deployment.request("POST", f"/v1/models/{name}/predict", {"text": t, **extra})[2] for t in TEXTS]
        np.testing.assert_allclose(np.array([n["embedding"] for n in native]), reference, atol=1e-5)
        with zserve.Client.from_config(deployment.config_path) as client:
            direct = [client.predict(name, {"text": t, **extra})["embedding"] for t in TEXTS]
        np.testing.assert_allclose(np.array(direct), reference, atol=1e-5)


def test_dimensions_and_token_ids_over_http(deployment, stacks):
    oai = openai.OpenAI(base_url=deployment.url + "/v1", api_key="none", max_retries=0, timeout=60)
    out = oai.embeddings.create(model="cls-dense", input="hello world", encoding_format="float")
    default = np.array(out.data[0].embedding)
    assert default.shape == (16,)  # the folder's truncate_dim, not renormalised (as encode)
    full = _library(stacks["cls-dense"]).encode("hello world", truncate_dim=None)
    np.testing.assert_allclose(default, full[:16], atol=1e-5)
    eight = np.array(oai.embeddings.create(model="cls-dense", input="hello world", dimensions=8).data[0].embedding)
    np.testing.assert_allclose(eight, full[:8] / np.linalg.norm(full[:8]), atol=1e-5)
    ids = _library(stacks["cls-dense"]).tokenizer("hello world")["input_ids"]
    by_ids = oai.embeddings.create(model="cls-dense", input=[ids, ids], encoding_format="float")
    by_text = oai.embeddings.create(model="cls-dense", input="hello world", encoding_format="float")
    np.testing.assert_allclose(by_ids.data[1].embedding, by_text.data[0].embedding, atol=1e-5)
    assert by_ids.usage.prompt_tokens == 2 * len(ids)
    with pytest.raises(openai.BadRequestError) as info:
        oai.embeddings.create(model="cls-dense", input="x", dimensions=17)  # the model's size is its truncate_dim
    assert info.value.body["param"] == "dimensions"


def test_cross_encoder_folder_scores_equal_cross_encoder_predict(deployment):
    from sentence_transformers import CrossEncoder

    query, documents = "what is the capital of france?", ["paris is the capital of france.", "the lazy dog", "berlin"]
    expected = CrossEncoder(str(deployment.cross_encoder)).predict([(query, d) for d in documents])
    status, _, out = deployment.request("POST", "/v1/score", {"model": "ce", "text_1": query, "text_2": documents})
    assert status == 200, out
    np.testing.assert_allclose([d["score"] for d in out["data"]], expected, atol=1e-5)
    status, _, out = deployment.request("POST", "/v1/rerank", {"model": "ce", "query": query, "documents": documents})
    assert [r["index"] for r in out["results"]] == list(np.argsort(-expected))
    body = {"model": "ce", "query": query, "documents": ["ok", "word " * 200], "truncate": False}
    status, _, out = deployment.request("POST", "/v1/rerank", body)
    assert status == 400 and out["error"]["param"] == "documents", out


def test_zserve_serve_infers_each_library_folder(stacks, tmp_path, tiny_cross_encoder):
    from sentence_transformers import CrossEncoder

    from zserve.deploy.quickstart import infer_task, read_model_config

    CrossEncoder(str(tiny_cross_encoder)).save(str(tmp_path / "ce"))
    for folder, task in [(stacks["lasttoken-prompts"], "embed"), (tmp_path / "ce", "rerank")]:
        assert infer_task(*read_model_config(str(folder))) == task  # a Llama's config says nothing of embedding


def test_a_folder_the_library_cannot_load_stops_the_deployment_without_restarts(stacks, tmp_path):
    import shutil

    broken = shutil.copytree(stacks["cls-dense"], tmp_path / "broken")
    modules = json.loads((broken / "modules.json").read_text())
    modules[2]["type"] = "sentence_transformers.no_such_module.Dense"
    (broken / "modules.json").write_text(json.dumps(modules))
    d = Deployment(write_config(tmp_path, f"[frontends]\nport = {free_port()}\n" + MODEL.format(name="b", path=broken)))
    assert d.proc.wait(timeout=120) != 0
    assert "no_such_module" in d.output and str(broken) in d.output
    assert "cannot load its model" in d.output and "restarting in" not in d.output

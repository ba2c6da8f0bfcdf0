"""``zserve.models.rerank:CrossEncoderRerank``: a cross-encoder (an ``AutoModelForSequenceClassification``
folder with one output, e.g. ms-marco-MiniLM or bge-reranker) scoring how well a document answers a
query. Served at ``POST /v1/rerank`` (Cohere's and vLLM's shape) and ``POST /v1/score`` (vLLM's), where
each (query, document) pair is its own broker request, batched with every other pair.

Options: ``path`` (a ``from_pretrained`` folder, required), ``max_length`` (tokens of query + document,
default 512), ``activation`` (``"sigmoid"``, the default, as sentence-transformers' CrossEncoder applies
to a one-output model: scores in 0..1; or ``"none"``: the raw logit).

Request body (native route): ``{"query": "...", "document": "..."}``. Response: ``{"score": 0.93}``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zserve.models.text import TextModel, object_body, reject_unknown, text_field

ACTIVATIONS = ("sigmoid", "none")


class CrossEncoderRerank(TextModel):
    auto_class = "AutoModelForSequenceClassification"

    def __init__(self, path: str = "", max_length: int = 512, activation: str = "sigmoid") -> None:
        super().__init__(path=path, max_length=max_length, activation=activation)
        if not path:
            raise ValueError("CrossEncoderRerank needs [models.options] path (a from_pretrained folder)")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, not {activation!r}")
        self.activation = activation

    def decode_request(self, body: Any) -> list[str]:
        body = object_body(body, '{"query": "...", "document": "..."}', "query")
        reject_unknown(body, ("query", "document"))
        return [text_field(body, "query"), text_field(body, "document")]

    def item_texts(self, item: list[str]) -> tuple[str, str | None]:
        return item[0], item[1]

    def preprocess(self, items: list[list[str]]) -> dict[str, np.ndarray]:
        return self.tokenize([item[0] for item in items], [item[1] for item in items])

    def setup(self, device: str) -> None:
        super().setup(device)
        labels = self.model.config.num_labels
        if labels != 1:
            raise ValueError(
                f"{self.folder()}: a cross-encoder has one output, this model has {labels} labels; serve it with "
                "zserve.models.classification:SequenceClassification"
            )

    def predict(self, batch: dict[str, np.ndarray]) -> list[float]:
        torch = self.torch
        with torch.inference_mode():
            logits = self.model(**self.inputs(batch)).logits.float()[:, 0]
            scores = logits.sigmoid() if self.activation == "sigmoid" else logits
        return scores.cpu().tolist()

    def encode_response(self, output: float) -> dict[str, Any]:
        return {"score": output}

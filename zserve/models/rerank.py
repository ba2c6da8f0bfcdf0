"""``zserve.models.rerank:CrossEncoderRerank``: a cross-encoder (a sentence-transformers ``CrossEncoder`` folder, or
an ``AutoModelForSequenceClassification`` folder with one output, e.g. ms-marco-MiniLM or bge-reranker) scoring how
well a document answers a query, computed by sentence-transformers as ``CrossEncoder.predict`` computes it (its
activation from the folder's config: sigmoid for a one-output model that names none). Served at
``POST /v1/rerank`` (Cohere's and vLLM's shape) and ``POST /v1/score`` (vLLM's), where each (query, document)
pair is its own broker request, batched with every other pair. Tokenising runs on the preprocess stages, the
forward on the engines (see ``zserve.models.st_library``).

Options: ``path`` (a ``from_pretrained`` folder, required), ``max_length`` (tokens of query + document; 0, the
default, is the model's own limit), ``activation`` (``"auto"``, the default: the library's, from the folder's
config; ``"sigmoid"``: scores in 0..1; ``"none"``: the raw logit), ``dtype`` (as ``SentenceEmbedding``'s).

Request body (native route): ``{"query": "...", "document": "...", "truncate"?: true}``; ``truncate: false`` makes a
pair longer than the model's limit a 400 naming ``document``. Response: ``{"score": 0.93}``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zserve.errors import BadRequest, ModelLoadError
from zserve.models import st_library
from zserve.models.text import TextModel, object_body, reject_unknown, text_field

ACTIVATIONS = ("auto", "sigmoid", "none")


class CrossEncoderRerank(TextModel):
    def __init__(self, path: str = "", max_length: int = 0, activation: str = "auto", dtype: str = "auto") -> None:
        super().__init__(path=path, max_length=max_length, activation=activation, dtype=dtype)
        if not path:
            raise ValueError("CrossEncoderRerank needs [models.options] path (a from_pretrained folder)")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, not {activation!r}")
        self.activation = activation

    # ---- frontends ----

    def decode_request(self, body: Any) -> list[Any]:
        body = object_body(body, '{"query": "...", "document": "..."}', "query")
        reject_unknown(body, ("query", "document", "truncate"))
        truncate = body.get("truncate", True)
        if not isinstance(truncate, bool):
            raise BadRequest("`truncate` must be true or false", field="truncate")
        return [text_field(body, "query"), text_field(body, "document"), truncate]

    def item_texts(self, item: list[Any]) -> tuple[str, str | None]:
        return item[0], item[1]

    def encode_response(self, output: dict[str, Any]) -> dict[str, Any]:
        return {"score": output["score"]}

    # ---- preprocess stage ----

    def setup_preprocess(self) -> None:
        from sentence_transformers import CrossEncoder

        self.stage = st_library.stage_copy(CrossEncoder, self.folder(), self.max_length)
        self.limit = self.stage.max_seq_length
        self.tokenizer = self.stage.tokenizer

    def preprocess(self, items: list[list[Any]]) -> dict[str, Any]:
        errors, rows = [], []
        for row, (query, document, truncate) in enumerate(items):
            count = len(self.tokenizer(query, document)["input_ids"]) if not truncate else 0
            if count > self.limit:
                errors.append([row, f"query and document have {count} tokens, above the model's limit of "
                                    f"{self.limit}; send `truncate: true` to cut them", "document"])  # fmt: skip
            else:
                rows.append(row)
        tokens = [0] * len(items)
        groups = []
        if rows:
            features = st_library.arrays(self.stage.preprocess([(items[r][0], items[r][1]) for r in rows]))
            for row, count in zip(rows, features["attention_mask"].sum(axis=1).tolist(), strict=True):
                tokens[row] = count
            groups.append({"rows": rows, "features": features})
        return {"groups": groups, "tokens": tokens, "errors": errors}

    # ---- engine ----

    def setup(self, device: str) -> None:
        from sentence_transformers import CrossEncoder

        model = st_library.load(CrossEncoder, self.folder(), device)
        if model.num_labels != 1:
            raise ModelLoadError(
                f"{self.folder()}: a cross-encoder has one output, this model has {model.num_labels} labels; serve "
                "it with zserve.models.classification:SequenceClassification"
            )
        import torch

        activations = {"auto": model.activation_fn, "sigmoid": torch.sigmoid, "none": lambda x: x}
        self.activation_fn = activations[self.activation]
        self.forward = st_library.Forward(model, device, self.dtype)

    def warmup(self) -> None:
        features = st_library.arrays(self.forward.model.preprocess([("warm up", "the engine")]))
        self.predict({"groups": [{"rows": [0], "features": features}], "tokens": [6], "errors": []})

    def predict(self, batch: dict[str, Any]) -> list[Any]:
        groups = batch["groups"]
        outputs: list[Any] = [None] * len(batch["tokens"])
        if groups:
            logits = [self.forward(group["features"])["scores"] for group in groups]
            # As CrossEncoder.predict: float32 logits, its activation, one score per pair.
            scores = self.forward.rows_to_host([g["rows"] for g in groups], logits, len(outputs), self.activation_fn)
            for row, tokens in enumerate(batch["tokens"]):
                outputs[row] = {"score": float(np.reshape(scores[row], -1)[0]), "tokens": tokens}
        for row, message, field in batch["errors"]:
            outputs[row] = BadRequest(message, field=field)
        return outputs

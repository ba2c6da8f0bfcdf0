"""``zserve.models.classification:SequenceClassification``: any ``AutoModelForSequenceClassification``
folder (sentiment, topic, NLI, ...), labels from the model's ``id2label``.

Options: ``path`` (a ``from_pretrained`` folder, required), ``max_length`` (tokens, default 512),
``top_k`` (labels in each answer, best first; 0 = all, the default), ``function_to_apply``
(``"auto"``: softmax, or sigmoid for a multi-label model or one with a single label, as Hugging Face's
text-classification pipeline does; or ``"softmax"``, ``"sigmoid"``, ``"none"``).

Request body: ``{"text": "..."}`` or ``{"text": "...", "text_pair": "..."}`` (NLI premise and hypothesis).
Response: ``{"label": "POSITIVE", "score": 0.98, "labels": [{"label": ..., "score": ...}, ...]}``.
Tokenisation runs on preprocess stages; ``cost`` gives tokens for ``max_batch_cost``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zserve.models.text import TextModel, object_body, optional_text_field, reject_unknown, text_field

FUNCTIONS = ("auto", "softmax", "sigmoid", "none")


class SequenceClassification(TextModel):
    auto_class = "AutoModelForSequenceClassification"

    def __init__(self, path: str = "", max_length: int = 512, top_k: int = 0, function_to_apply: str = "auto") -> None:
        super().__init__(path=path, max_length=max_length, top_k=top_k, function_to_apply=function_to_apply)
        if not path:
            raise ValueError("SequenceClassification needs [models.options] path (a from_pretrained folder)")
        if function_to_apply not in FUNCTIONS:
            raise ValueError(f"function_to_apply must be one of {', '.join(FUNCTIONS)}, not {function_to_apply!r}")
        if int(top_k) < 0:
            raise ValueError("top_k must be 0 (all labels) or more")
        self.top_k = int(top_k)
        self.function_to_apply = function_to_apply

    def decode_request(self, body: Any) -> list[Any]:
        body = object_body(body, '{"text": "...", "text_pair"?: "..."}', "text")
        reject_unknown(body, ("text", "text_pair"))
        return [text_field(body, "text"), optional_text_field(body, "text_pair")]

    def item_texts(self, item: list[Any]) -> tuple[str, str | None]:
        return item[0], item[1]

    def preprocess(self, items: list[list[Any]]) -> dict[str, np.ndarray]:
        texts = [item[0] for item in items]
        pairs = [item[1] for item in items]
        if all(pair is None for pair in pairs):
            return self.tokenize(texts)
        if any(pair is None for pair in pairs):  # a batch mixing single texts and pairs: one call each way
            return self._tokenize_mixed(texts, pairs)
        return self.tokenize(texts, pairs)

    def _tokenize_mixed(self, texts: list[str], pairs: list[str | None]) -> dict[str, np.ndarray]:
        rows = [self.tokenize([t], None if p is None else [p]) for t, p in zip(texts, pairs, strict=True)]
        width = max(row["input_ids"].shape[1] for row in rows)
        pad = self.tokenizer.pad_token_id or 0
        out: dict[str, np.ndarray] = {}
        for key in rows[0]:
            fill = pad if key == "input_ids" else 0
            out[key] = np.stack(
                [np.pad(row[key][0], (0, width - row[key].shape[1]), constant_values=fill) for row in rows]
            )
        return out

    def setup(self, device: str) -> None:
        super().setup(device)
        config = self.model.config
        self.labels = [config.id2label.get(i, f"LABEL_{i}") for i in range(config.num_labels)]
        function = self.function_to_apply
        if function == "auto":
            multi = config.problem_type == "multi_label_classification" or config.num_labels == 1
            function = "sigmoid" if multi else "softmax"
        self.function = function

    def predict(self, batch: dict[str, np.ndarray]) -> list[dict[str, Any]]:
        torch = self.torch
        with torch.inference_mode():
            logits = self.model(**self.inputs(batch)).logits.float()
            if self.function == "softmax":
                scores = logits.softmax(dim=-1)
            elif self.function == "sigmoid":
                scores = logits.sigmoid()
            else:
                scores = logits
        return ranked_labels(scores, self.labels, self.top_k)

    def encode_response(self, output: dict[str, Any]) -> dict[str, Any]:
        return encode_ranked(output)


def ranked_labels(scores: Any, labels: list[str], top_k: int) -> list[dict[str, Any]]:
    """Per row of ``scores`` (a torch tensor, batch x labels): the ``top_k`` best labels (0: all) and their
    scores, best first, as compact lists (what travels back to the frontend)."""
    values, indices = scores.topk(min(top_k or len(labels), len(labels)), dim=-1)
    return [
        {"labels": [labels[i] for i in row_indices], "scores": row_values}
        for row_values, row_indices in zip(values.cpu().tolist(), indices.cpu().tolist(), strict=True)
    ]


def encode_ranked(output: dict[str, Any]) -> dict[str, Any]:
    ranked = [{"label": label, "score": score} for label, score in zip(output["labels"], output["scores"], strict=True)]
    return {"label": ranked[0]["label"], "score": ranked[0]["score"], "labels": ranked}

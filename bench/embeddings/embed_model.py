"""zserve's embedding handler run in this process (the in-process limit and the mosec app), through its own hooks
only (``decode_request``, ``preprocess``, ``predict``), so this keeps working as the handler's batch format changes.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from zserve.model import Model, load_handler, setup_inline, uses_preprocess

HANDLER = "zserve.models.embedding:SentenceEmbedding"


def load(model_dir: str, threads: int, options: dict[str, Any] | None = None) -> Model:
    """The handler on ``model_dir`` (with ``options``: backend, dtype), set up and warmed up here, torch on ``threads``
    intra-op threads."""
    model = load_handler(HANDLER, {"path": model_dir, **(options or {})})
    setup_inline(model)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
    return model


def items(model: Model, texts: list[str]) -> list[Any]:
    return [model.decode_request({"text": text}) for text in texts]


def preprocess(model: Model, batch: list[Any]) -> Any:
    return model.preprocess(batch) if uses_preprocess(type(model)) else batch


def _masks(obj: Any) -> Iterator[np.ndarray]:
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key == "attention_mask":
                yield np.asarray(value)
            else:
                yield from _masks(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _masks(value)


def padding(features: Any) -> tuple[int, int]:
    """(real tokens, padded tokens) of a preprocessed batch: the sums and sizes of its attention masks."""
    real = padded = 0
    for mask in _masks(features):
        real += int(mask.sum())
        padded += int(mask.size)
    return real, padded


def vector(output: Any) -> np.ndarray:
    """The embedding of one ``predict`` output (a vector, or a dict with ``embedding``)."""
    if isinstance(output, Exception):
        raise output
    if isinstance(output, dict):
        output = output["embedding"]
    return np.asarray(output, dtype=np.float32)

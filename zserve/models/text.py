"""What the built-in text handlers share (``SentenceEmbedding``, ``SequenceClassification``,
``CrossEncoderRerank``): a ``from_pretrained`` folder, tokenisation on the preprocess stages (the tokenizer
is loaded in ``setup_preprocess``; engines only run the forward pass), token counts for ``usage`` and for
cost-aware batching, and the checks of text fields.

Token counting runs in the frontends, per request, so it uses the folder's ``tokenizer.json`` through
``tokenizers`` alone: frontends never import transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from zserve.errors import BadRequest
from zserve.model import Model
from zserve.models.st_library import HF_LOAD_KWARGS, check_dtype, torch_dtype

MAX_TEXT_CHARS = 100_000
COUNT_LIMIT = 512  # tokens counted for cost where max_length = 0 (the model's limit, which frontends do not load)


def text_field(body: dict[str, Any], key: str) -> str:
    """``body[key]``, required: a string of at most MAX_TEXT_CHARS; a 400 naming ``key`` otherwise."""
    value = optional_text_field(body, key)
    if value is None:
        raise BadRequest(f"`{key}` is required", field=key)
    return value


def optional_text_field(body: dict[str, Any], key: str) -> str | None:
    """``body[key]`` (None when absent or null), checked like ``text_field``."""
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise BadRequest(f"`{key}` must be a string", field=key)
    if len(value) > MAX_TEXT_CHARS:
        raise BadRequest(f"`{key}` is longer than {MAX_TEXT_CHARS} characters", field=key)
    return value


def object_body(body: Any, shape: str, field: str) -> dict[str, Any]:
    """``body`` if it is a JSON object; else a 400 naming ``field`` (the one a user most likely forgot)."""
    if not isinstance(body, dict):
        raise BadRequest(f"body must be a JSON object {shape}", field=field)
    return body


def reject_unknown(body: dict[str, Any], allowed: tuple[str, ...]) -> None:
    """A 400 naming the first key of ``body`` not in ``allowed`` (a typo must not be silently ignored)."""
    for key in body:
        if key not in allowed:
            raise BadRequest(f"unknown field `{key}`; expected {', '.join(allowed)}", field=key)


class TextModel(Model):
    """A transformers text model in a local folder (or a hub name, where a hub is reachable). Subclasses
    say which ``AutoModel*`` class loads it (``auto_class``) and what ``predict`` computes."""

    auto_class = "AutoModel"
    preprocess_in_idle_engine = True  # tokenising a batch takes well under a millisecond

    def __init__(self, path: str = "", max_length: int = 512, dtype: str = "auto", **options: Any) -> None:
        super().__init__(path=path, max_length=max_length, dtype=dtype, **options)
        self.path = path
        self.max_length = int(max_length)
        if self.max_length < 0:
            raise ValueError("max_length must be 0 (the model's own limit) or more")
        self.dtype = check_dtype(dtype)
        self._counter: Any = None  # a tokenizers.Tokenizer, loaded by the first count
        self._counter_missing = False

    def folder(self) -> str:
        """What ``from_pretrained`` loads."""
        if not self.path:
            raise ValueError(f"{type(self).__name__} needs [models.options] path (a from_pretrained folder)")
        return self.path

    # ---- preprocess stage ----

    def setup_preprocess(self) -> None:
        # Imported here: frontends construct this class too and must not pay for transformers.
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.folder())

    def tokenize(self, texts: list[str], pairs: list[str] | None = None) -> dict[str, np.ndarray]:
        """The batch as padded numpy arrays (they travel to the engine as raw frames)."""
        args = (texts, pairs) if pairs is not None else (texts,)
        limit = self.max_length or None  # None: the tokenizer's model_max_length
        tokens = self.tokenizer(*args, padding=True, truncation=True, max_length=limit, return_tensors="np")
        return {key: np.asarray(value, dtype=np.int64) for key, value in tokens.items()}

    # ---- engine ----

    def setup(self, device: str) -> None:
        import torch
        import transformers
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one log line per event, not a progress bar per load
        self.torch = torch
        self.device = torch.device(device)
        auto = getattr(transformers, self.auto_class)
        dtype = torch_dtype(self.dtype, self.device)
        self.model = auto.from_pretrained(self.folder(), dtype=dtype, **HF_LOAD_KWARGS).to(self.device).eval()

    def warmup(self) -> None:
        self.predict({"input_ids": np.array([[1, 2, 3]], dtype=np.int64), "attention_mask": np.ones((1, 3), np.int64)})

    def inputs(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        """The tokenised batch as tensors on the device, only the keys the model's forward takes."""
        torch = self.torch
        # np.array copies: arrays decoded from frames are read-only views, which torch will not wrap.
        return {
            key: torch.from_numpy(np.array(value, dtype=np.int64)).to(self.device)
            for key, value in batch.items()
            if key in ("input_ids", "attention_mask", "token_type_ids")
        }

    # ---- frontends ----

    def count_tokens(self, texts: list[str], pairs: list[str] | None = None) -> list[int] | None:
        """The tokens ``tokenize`` gives each text (or pair; special tokens and truncation included), counted
        with the folder's ``tokenizer.json``. None if the folder has no such file (a hub name, a slow
        tokenizer)."""
        if self._counter is None:
            if self._counter_missing:
                return None
            from tokenizers import Tokenizer

            path = Path(self.folder()) / "tokenizer.json"
            if not path.is_file():
                self._counter_missing = True
                return None
            self._counter = Tokenizer.from_file(str(path))
            self._counter.no_padding()
            self._counter.enable_truncation(self.max_length or COUNT_LIMIT)
        if pairs is None:
            return [len(e.ids) for e in self._counter.encode_batch(texts)]
        return [len(e.ids) for e in self._counter.encode_batch(list(zip(texts, pairs, strict=True)))]

    def cost(self, item: Any) -> int:
        """Tokens (what a padded batch computes per row), for ``max_batch_cost``; a character estimate
        without a tokenizer.json."""
        texts, pairs = self.item_texts(item)
        counts = self.count_tokens([texts], None if pairs is None else [pairs])
        if counts is None:
            return max(1, min(self.max_length, (len(texts) + len(pairs or "")) // 4))
        return counts[0]

    def item_texts(self, item: Any) -> tuple[str, str | None]:
        """An item's text and its pair (None), as ``decode_request`` made it."""
        return item, None

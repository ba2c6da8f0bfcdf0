"""OpenAI's ``POST /v1/embeddings`` for the embedding models (``zserve.models.embedding:SentenceEmbedding``).

Each input is submitted as its own request, exactly as ``/v1/models/{name}/predict`` submits one, so the
broker batches the inputs of one call with each other and with the native route's traffic. Errors come in
OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from typing import Any

import falcon
import falcon.asgi
import msgspec
import numpy as np

from zserve.client import AsyncClient
from zserve.errors import BadRequest
from zserve.frontends import metrics
from zserve.frontends.api_types import Embedding, EmbeddingList, EmbeddingRequest, EmbeddingUsage, decode_body
from zserve.frontends.resources import RequestError, decode_item, openai_error, read_json, request_error
from zserve.model import Model
from zserve.models.embedding import SentenceEmbedding

log = logging.getLogger("zserve.frontend")
_json = msgspec.json.Encoder()


def embedding_models(handlers: dict[str, Model]) -> dict[str, SentenceEmbedding]:
    return {name: h for name, h in handlers.items() if isinstance(h, SentenceEmbedding)}


def _vector(output: np.ndarray, encoding_format: str) -> list[float] | str:
    vector = np.asarray(output, dtype="<f4")  # what OpenAI's base64 holds: little-endian float32
    return base64.b64encode(vector.tobytes()).decode() if encoding_format == "base64" else vector.tolist()


async def gather_or_cancel(coros: list[Any]) -> list[Any]:
    """All results, or the first error with the other requests cancelled (no work for a failed call)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


class EmbeddingsResource:
    def __init__(self, client: AsyncClient, handlers: dict[str, Model], max_body_bytes: int) -> None:
        self.client = client
        self.models = embedding_models(handlers)  # SentenceEmbedding: count_tokens gives the usage
        self.max_body_bytes = max_body_bytes
        self.metrics = {name: metrics.ModelMetrics(name) for name in self.models}
        self._warned_no_counts = False

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        started = time.perf_counter()
        name, code, answers = "", 200, []
        try:
            body = await read_json(req, self.max_body_bytes)
            if isinstance(body, dict) and body.get("dimensions") is not None:
                raise BadRequest("`dimensions` is not supported: vectors have the model's own size", field="dimensions")
            request = decode_body(body, EmbeddingRequest)
            name = request.model
            model = self.models.get(name)
            if model is None:
                raise RequestError(404, "model_not_found", f"no embedding model named {name!r}; see GET /v1/models",
                                   "model")  # fmt: skip
            texts = [request.input] if isinstance(request.input, str) else request.input
            items = []
            for i, text in enumerate(texts):
                try:
                    items.append(decode_item(model, {"text": text}))
                except BadRequest as exc:
                    raise BadRequest(f"input {i}: {exc.message}", field="input") from None
            answers = await gather_or_cancel([self.client.infer(name, item, decoded=True) for item in items])
        except Exception as exc:
            error = request_error(exc)
            if error is None:
                raise
            code = error.status
            openai_error(resp, code, error.type_name, error.message, error.field)
        else:
            counts = model.count_tokens(texts)
            if counts is None and not self._warned_no_counts:
                self._warned_no_counts = True
                log.warning("model %s: no tokenizer.json in its folder, usage.prompt_tokens reads 0", name)
            tokens = sum(counts or ())
            data = [Embedding("embedding", i, _vector(a.value, request.encoding_format)) for i, a in enumerate(answers)]
            resp.data = _json.encode(EmbeddingList("list", data, name, EmbeddingUsage(tokens, tokens)))
            resp.content_type = falcon.MEDIA_JSON
        finally:
            model_metrics = self.metrics.get(name)
            if model_metrics is not None:  # one count per input, as if each had come to the native route
                latency_s = time.perf_counter() - started
                for answer in answers or [None]:
                    model_metrics.answered(code, latency_s, answer.batch_size if answer else 0)

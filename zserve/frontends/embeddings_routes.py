"""OpenAI's ``POST /v1/embeddings`` for the embedding models (``zserve.models.embedding:SentenceEmbedding``).

Each input is submitted as its own request, exactly as ``/v1/models/{name}/predict`` submits one (the same body,
with the request's ``dimensions``, ``prompt_name``, ``prompt`` and ``truncate``), so the broker batches the inputs
of one call with each other and with the native route's traffic. ``usage`` counts the tokens the model read, as
its stage tokenised them (prompts included). Errors come in OpenAI's shape.
"""

from __future__ import annotations

import base64
import time
from typing import Any

import falcon
import falcon.asgi
import msgspec
import numpy as np

from zserve.client import AsyncClient
from zserve.client.aio import gather_or_cancel
from zserve.errors import BadRequest
from zserve.frontends import metrics
from zserve.frontends.api_types import Embedding, EmbeddingList, EmbeddingRequest, EmbeddingUsage, decode_body
from zserve.frontends.limits import Limits
from zserve.frontends.resources import (
    RequestError,
    answer_error,
    decode_item,
    openai_error,
    priority_and_tenant,
    read_json,
)
from zserve.model import Model
from zserve.models.embedding import SentenceEmbedding

_json = msgspec.json.Encoder()


def embedding_models(handlers: dict[str, Model]) -> dict[str, SentenceEmbedding]:
    return {name: h for name, h in handlers.items() if isinstance(h, SentenceEmbedding)}


def _vector(output: np.ndarray, encoding_format: str) -> list[float] | str:
    vector = np.asarray(output, dtype="<f4")  # what OpenAI's base64 holds: little-endian float32
    return base64.b64encode(vector.tobytes()).decode() if encoding_format == "base64" else vector.tolist()


def input_count(request: EmbeddingRequest) -> int:
    """How many inputs ``request`` holds (one text, or one list of token ids, is one), counted before any is
    copied: a request past ``[limits] max_inputs`` is refused at this cost."""
    value = request.input
    return 1 if isinstance(value, str) or isinstance(value[0], int) else len(value)


def input_bodies(request: EmbeddingRequest) -> list[dict[str, Any]]:
    """The native route's body for each input of an OpenAI request (texts or token ids), carrying its options."""
    value = request.input
    if isinstance(value, str) or all(isinstance(v, str) for v in value):
        bodies = [{"text": text} for text in ([value] if isinstance(value, str) else value)]
    elif all(isinstance(v, int) for v in value):
        bodies = [{"input_ids": value}]
    elif all(isinstance(v, list) for v in value):
        bodies = [{"input_ids": ids} for ids in value]
    else:
        raise BadRequest("`input` mixes texts, token ids and lists of token ids: give one kind", field="input")
    options = {"prompt_name": request.prompt_name, "prompt": request.prompt, "dimensions": request.dimensions,
               "truncate": request.truncate}  # fmt: skip
    options = {key: v for key, v in options.items() if v is not None}
    return [{**body, **options} for body in bodies]


def _as_input_field(exc: BadRequest) -> BadRequest:
    """The handler names `text` or `input_ids`; OpenAI's body calls both `input`."""
    if exc.field in ("text", "input_ids"):
        exc.field = "input"
    return exc


class EmbeddingsResource:
    def __init__(
        self, client: AsyncClient, handlers: dict[str, Model], max_body_bytes: int, limits: Limits | None = None
    ) -> None:
        self.client = client
        self.models = embedding_models(handlers)
        self.max_body_bytes = max_body_bytes
        self.limits = limits or Limits()
        self.metrics = {name: metrics.ModelMetrics(name) for name in self.models}

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        started = time.perf_counter()
        name, code, answers = "", 200, []
        try:
            request = decode_body(await read_json(req, self.max_body_bytes), EmbeddingRequest)
            name = request.model
            model = self.models.get(name)
            if model is None:
                raise RequestError(404, "model_not_found", f"no embedding model named {name!r}; see GET /v1/models",
                                   "model")  # fmt: skip
            self.limits.check_inputs(name, input_count(request), "input")
            items = []
            for i, body in enumerate(input_bodies(request)):
                try:
                    items.append(decode_item(model, body))
                except BadRequest as exc:
                    if exc.field not in ("text", "input_ids"):
                        raise  # an option of the whole request, named as it is
                    raise BadRequest(f"input {i}: {exc.message}", field="input") from None
            try:
                priority, tenant = priority_and_tenant(req, request.priority)
                answers = await gather_or_cancel(
                    [self.client.infer(name, item, decoded=True, priority=priority, tenant=tenant) for item in items]
                )
            except BadRequest as exc:  # what only the model's files can tell, checked on its stage
                raise _as_input_field(exc) from None
        except Exception as exc:
            code = answer_error(resp, exc, openai_error)
        else:
            tokens = sum(a.value["tokens"] for a in answers)  # what the model read, prompts included
            data = [
                Embedding("embedding", i, _vector(a.value["embedding"], request.encoding_format))
                for i, a in enumerate(answers)
            ]
            resp.data = _json.encode(EmbeddingList("list", data, name, EmbeddingUsage(tokens, tokens)))
            resp.content_type = falcon.MEDIA_JSON
        finally:
            model_metrics = self.metrics.get(name)
            if model_metrics is not None:
                model_metrics.answered_each(code, time.perf_counter() - started, answers)

"""``POST /v1/rerank`` (also ``/v2/rerank``; the shape of Cohere's and vLLM's rerank APIs) and
``POST /v1/score`` (vLLM's score API) for the cross-encoder models
(``zserve.models.rerank:CrossEncoderRerank``).

Each (query, document) pair is submitted as its own request, as ``/v1/models/{name}/predict`` submits
one, so the broker batches the pairs of one call with each other, with other calls' and with the native
route's traffic (and by tokens, with ``max_batch_cost``). Errors come in OpenAI's shape, as vLLM's do.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import falcon
import falcon.asgi
import msgspec

from zserve.client import AsyncClient
from zserve.client.aio import gather_or_cancel
from zserve.errors import BadRequest
from zserve.frontends import metrics
from zserve.frontends.api_types import (
    EmbeddingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    decode_body,
)
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
from zserve.models.rerank import CrossEncoderRerank

_json = msgspec.json.Encoder()


def rerank_models(handlers: dict[str, Model]) -> dict[str, CrossEncoderRerank]:
    return {name: h for name, h in handlers.items() if isinstance(h, CrossEncoderRerank)}


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one against one, one against many, or pairwise for two lists of the same length."""
    firsts = [text_1] if isinstance(text_1, str) else text_1
    seconds = [text_2] if isinstance(text_2, str) else text_2
    if len(firsts) == 1:
        return [(firsts[0], second) for second in seconds]
    if len(firsts) != len(seconds):
        raise BadRequest(
            f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give text_1 one text, or both the same "
            "number (scored pairwise)",
            field="text_2",
        )
    return list(zip(firsts, seconds, strict=True))


class _PairsResource:
    """Decode a body, score its (query, document) pairs through the broker, answer; subclasses say how a
    body becomes pairs and how scores become the answer."""

    def __init__(
        self, client: AsyncClient, handlers: dict[str, Model], max_body_bytes: int, limits: Limits | None = None
    ) -> None:
        self.client = client
        self.models = rerank_models(handlers)
        self.max_body_bytes = max_body_bytes
        self.limits = limits or Limits()
        self.metrics = {name: metrics.ModelMetrics(name) for name in self.models}

    def pairs(self, body: Any) -> tuple[str, Any, list[tuple[str, str]], str]:
        """(model name, the decoded request, its pairs, the request field the documents came in)."""
        raise NotImplementedError

    def answer(self, name: str, request: Any, pairs: list[tuple[str, str]], scores: list[float], tokens: int) -> Any:
        raise NotImplementedError

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        started = time.perf_counter()
        name, code, answers = "", 200, []
        try:
            body = await read_json(req, self.max_body_bytes)
            name, request, pairs, field = self.pairs(body)
            model = self.models.get(name)
            if model is None:
                raise RequestError(404, "model_not_found", f"no rerank model named {name!r}; see GET /v1/models",
                                   "model")  # fmt: skip
            self.limits.check_inputs(name, len(pairs), field, "pairs")
            items = []
            for i, (query, document) in enumerate(pairs):
                try:
                    items.append(
                        decode_item(model, {"query": query, "document": document, "truncate": request.truncate})
                    )
                except BadRequest as exc:
                    raise BadRequest(f"{field} {i}: {exc.message}", field=field) from None
            # the key's tenant and priority, as on every route: quotas, fair share and max_priority hold here too
            priority, tenant = priority_and_tenant(req, body.get("priority"))
            try:
                answers = await gather_or_cancel(
                    [self.client.infer(name, item, decoded=True, priority=priority, tenant=tenant) for item in items]
                )
            except BadRequest as exc:  # a pair over the model's limit with truncate=false, found on its stage
                exc.field = field if exc.field == "document" else exc.field
                raise
        except Exception as exc:
            code = answer_error(resp, exc, openai_error)
        else:
            scores = [a.value["score"] for a in answers]
            tokens = sum(a.value["tokens"] for a in answers)  # what the model read, as its stage tokenised it
            resp.data = _json.encode(self.answer(name, request, pairs, scores, tokens))
            resp.content_type = falcon.MEDIA_JSON
        finally:
            model_metrics = self.metrics.get(name)
            if model_metrics is not None:
                model_metrics.answered_each(code, time.perf_counter() - started, answers)


class RerankResource(_PairsResource):
    def pairs(self, body: Any) -> tuple[str, RerankRequest, list[tuple[str, str]], str]:
        request = decode_body(body, RerankRequest)
        texts = [d if isinstance(d, str) else d.text for d in request.documents]
        return request.model, request, [(request.query, text) for text in texts], "documents"

    def answer(
        self, name: str, request: RerankRequest, pairs: list[tuple[str, str]], scores: list[float], tokens: int
    ) -> RerankResponse:
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: request.top_n]
        results = [
            RerankResult(i, scores[i], RerankDocument(pairs[i][1]) if request.return_documents else None) for i in order
        ]
        return RerankResponse(f"rerank-{uuid.uuid4().hex}", name, results, RerankUsage(tokens))


class ScoreResource(_PairsResource):
    def pairs(self, body: Any) -> tuple[str, ScoreRequest, list[tuple[str, str]], str]:
        request = decode_body(body, ScoreRequest)
        return request.model, request, score_pairs(request.text_1, request.text_2), "text_2"

    def answer(
        self, name: str, request: ScoreRequest, pairs: list[tuple[str, str]], scores: list[float], tokens: int
    ) -> ScoreResponse:
        data = [ScoreData(i, "score", score) for i, score in enumerate(scores)]
        return ScoreResponse(f"score-{uuid.uuid4().hex}", "list", int(time.time()), name, data,
                             EmbeddingUsage(tokens, tokens))  # fmt: skip

"""``GET /openapi.json``: the deployment's HTTP API as an OpenAPI 3.1 document, generated from the Structs
the routes decode and answer with (``zserve.frontends.api_types``, through
``msgspec.json.schema_components``), for the routes this deployment serves and its model names."""

from __future__ import annotations

from typing import Any

import falcon
import falcon.asgi
import msgspec

from zserve.frontends import api_types as t
from zserve.generation import GenerateRequest, GenerateResponse

_REF = "#/components/schemas/{name}"
_TYPES: tuple[Any, ...] = (
    t.Error, t.OpenAIError, t.ModelList, t.Live, t.Ready, t.CompletionRequest, t.Completion,
    t.ChatCompletionRequest, t.ChatCompletion, t.ChatCompletionChunk, t.MiiRequest,
    t.EmbeddingRequest, t.EmbeddingList, t.RerankRequest, t.RerankResponse, t.ScoreRequest, t.ScoreResponse,
    t.TokenizeRequest, t.TokenizeResponse, t.DetokenizeRequest, t.DetokenizeResponse,
    GenerateRequest, GenerateResponse,
)  # fmt: skip
_RETRY_AFTER = {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds to wait before retrying"}}
# Answered only to a request with an API key: its key's priority cap and its tenant's quotas.
_KEYED = (403, 429)
_WHY = {
    400: "a field is invalid (`field`/`param` names it), or the body is not JSON",
    401: "no API key, or not an accepted one (`Authorization: Bearer KEY`)",
    403: "`priority` (or `X-Zserve-Priority`) is more urgent than the API key's `max_priority`",
    404: "no such model",
    408: "the request was not sent whole within the keep-alive time",
    413: "the body is over `max_body_bytes`",
    429: "the API key's tenant is past a quota, named in `field`/`param` (see `Retry-After`)",
    500: "the model failed on this request",
    503: "overloaded, shutting down or not ready (see `Retry-After`)",
    504: "not answered within the model's `timeout_ms`",
}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _ref(struct: Any) -> dict[str, Any]:
    return {"$ref": _REF.format(name=struct.__name__)}


class _Builder:
    def __init__(self, secured: bool, auth_health: bool) -> None:
        self.secured = secured
        self.auth_health = auth_health
        self.paths: dict[str, dict[str, Any]] = {}

    def add(self, path: str, method: str, summary: str, ok: dict[str, Any], errors: tuple[int, ...],
            error_type: Any = t.Error, body: dict[str, Any] | None = None, health: bool = False,
            parameters: list[dict[str, Any]] | None = None, raw_body: bool = False) -> None:  # fmt: skip
        needs_key = self.secured and (self.auth_health or not health)
        codes = set(errors)
        if needs_key:
            codes.add(401)
            if not health and 503 in errors:  # a route whose requests reach the broker
                codes.update(_KEYED)
        responses = {str(c): _json(_ref(error_type), _WHY[c]) for c in sorted(codes)}
        for c in (429, 503):
            if c in codes:
                responses[str(c)]["headers"] = _RETRY_AFTER
        operation: dict[str, Any] = {
            "summary": summary,
            "operationId": f"{method}_{path.strip('/').replace('/', '_').replace('{', '').replace('}', '')}",
            "responses": {"200": ok, **responses},
        }
        if parameters:
            operation["parameters"] = parameters
        if body is not None:
            content = {"application/json": {"schema": body}}
            if raw_body:  # the bytes go to decode_request as they are (an image file, say)
                content["application/octet-stream"] = {"schema": {"type": "string", "format": "binary"}}
            operation["requestBody"] = {"required": True, "content": content}
        if needs_key:
            operation["security"] = [{"bearer": []}]
        self.paths.setdefault(path, {})[method] = operation


def _name_parameter(name: str, models: list[str]) -> list[dict[str, Any]]:
    return [{"name": name, "in": "path", "required": True, "schema": {"type": "string", "enum": models}}]


# One Server-Sent Event (what schemathesis checks each event against): `data` is a chunk's JSON, an error's
# (after text went out, errors travel in the stream) or `[DONE]`.
_SSE_EVENT = {
    "type": "object",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}, "id": {"type": "string"}},
    "required": ["data"],
}


def _sse_or_json(struct: Any, chunk: Any, what: str) -> dict[str, Any]:
    return {
        "description": f"{what}; with `stream: true`, Server-Sent Events whose data are {chunk.__name__} objects, "
        "then `[DONE]`",
        "content": {
            "application/json": {"schema": _ref(struct)},
            "text/event-stream": {"schema": _SSE_EVENT},
        },
    }


def openapi_document(
    models: list[str],
    generative: list[str],
    embedding: list[str],
    rerank: list[str],
    secured: bool,
    auth_health: bool,
) -> dict[str, Any]:
    """The document for a deployment serving ``models`` (of which ``generative``, ``embedding``, ``rerank``)."""
    _, components = msgspec.json.schema_components(_TYPES, ref_template=_REF)
    # This deployment's model names, so that clients (and schemathesis) see which ones exist.
    for struct, names in ((t.CompletionRequest, generative), (t.ChatCompletionRequest, generative),
                          (t.EmbeddingRequest, embedding), (t.RerankRequest, rerank),
                          (t.ScoreRequest, rerank)):  # fmt: skip
        if names:
            components[struct.__name__]["properties"]["model"]["enum"] = names
    for struct in (t.TokenizeRequest, t.DetokenizeRequest):  # model: a name, or null (the one generative model)
        if generative:
            components[struct.__name__]["properties"]["model"]["anyOf"][0]["enum"] = generative
    b = _Builder(secured, auth_health)
    errors = (400, 404, 413, 500, 503, 504)
    b.add("/v1/models/{name}/predict", "post", "Run one request through a model (its own body and answer: "
          "`decode_request`/`encode_response`; a generative model takes a GenerateRequest)",
          {**_json({}, "the model's answer"), "headers": {
              "X-Zserve-Batch-Size": {"schema": {"type": "integer"}, "description": "the batch it ran in"},
              "X-Zserve-Queue-Ms": {"schema": {"type": "number"}, "description": "time queued in the broker"}}},
          (*errors, 408), body={}, parameters=_name_parameter("name", models), raw_body=True)  # fmt: skip
    b.add("/v1/models", "get", "The models served", _json(_ref(t.ModelList), "the models"), ())
    b.add("/healthz", "get", "The frontend process is up", _json(_ref(t.Live), "up"), (), health=True)
    b.add("/readyz", "get", "Every model has a ready engine", _json(_ref(t.Ready), "ready"), (503,), health=True)
    metrics = {"description": "Prometheus text", "content": {"text/plain": {"schema": {"type": "string"}}}}
    b.add("/metrics", "get", "Prometheus metrics of all frontend workers and the broker", metrics, (), health=True)
    b.add("/openapi.json", "get", "This document", _json({"type": "object"}, "OpenAPI 3.1"), ())
    if generative:
        b.add("/v1/completions", "post", "OpenAI text completions",
              _sse_or_json(t.Completion, t.Completion, "the completion"), errors, t.OpenAIError,
              body=_ref(t.CompletionRequest))  # fmt: skip
        b.add("/v1/chat/completions", "post", "OpenAI chat completions",
              _sse_or_json(t.ChatCompletion, t.ChatCompletionChunk, "the chat completion"), errors, t.OpenAIError,
              body=_ref(t.ChatCompletionRequest))  # fmt: skip
        b.add("/mii/{deployment}", "post", "DeepSpeed-MII's REST route",
              _json({"type": "array", "items": _ref(GenerateResponse)}, "one answer per prompt"), errors,
              body=_ref(t.MiiRequest), parameters=_name_parameter("deployment", generative))  # fmt: skip
        b.add("/tokenize", "post", "vLLM's tokenize: a prompt's or chat messages' token ids, as the model takes them",
              _json(_ref(t.TokenizeResponse), "the token ids"), (400, 404, 413, 500), t.OpenAIError,
              body=_ref(t.TokenizeRequest))  # fmt: skip
        b.add("/detokenize", "post", "vLLM's detokenize: the text of token ids",
              _json(_ref(t.DetokenizeResponse), "the text"), (400, 404, 413, 500), t.OpenAIError,
              body=_ref(t.DetokenizeRequest))  # fmt: skip
    if embedding:
        b.add("/v1/embeddings", "post", f"OpenAI embeddings (models: {', '.join(embedding)})",
              _json(_ref(t.EmbeddingList), "one vector per input"), errors, t.OpenAIError,
              body=_ref(t.EmbeddingRequest))  # fmt: skip
    if rerank:
        for path in ("/v1/rerank", "/v2/rerank"):
            b.add(path, "post", f"Rerank documents by relevance to a query (Cohere's and vLLM's shape; models: "
                  f"{', '.join(rerank)})", _json(_ref(t.RerankResponse), "the documents, best first"), errors,
                  t.OpenAIError, body=_ref(t.RerankRequest))  # fmt: skip
        b.add("/v1/score", "post", f"Score text pairs (vLLM's shape; models: {', '.join(rerank)})",
              _json(_ref(t.ScoreResponse), "one score per pair"), errors, t.OpenAIError,
              body=_ref(t.ScoreRequest))  # fmt: skip
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "zserve", "version": "0.1.0", "description": "Models: " + ", ".join(models)},
        "paths": b.paths,
        "components": {"schemas": components},
    }
    if secured:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return document


class OpenApiResource:
    def __init__(self, document: dict[str, Any]) -> None:
        self.data = msgspec.json.encode(document)

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.data = self.data
        resp.content_type = falcon.MEDIA_JSON

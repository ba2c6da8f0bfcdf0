"""The falcon ASGI app of one frontend worker.

gunicorn runs ``zserve.frontends.app:create_frontend()`` in each worker process (never ``--preload``): the
app plus what its fast HTTP path needs (``fast_worker.py``); ``create_app()`` is the app alone. Every worker builds
its own AsyncClient, whose DEALER socket is created lazily inside the worker's event loop.
The supervisor passes the settings in the environment (ZSERVE_FRONTEND, JSON of FrontendSettings).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import falcon
import falcon.asgi
import msgspec

from zserve.client import AsyncClient
from zserve.config import FrontendSettings
from zserve.frontends.auth import RequireApiKey, api_keys_from
from zserve.frontends.embeddings_routes import EmbeddingsResource, embedding_models
from zserve.frontends.generate_routes import ChatCompletionsResource, CompletionsResource, MiiResource
from zserve.frontends.limits import Limits
from zserve.frontends.model_tokenizer import ModelTokenizer
from zserve.frontends.openapi import OpenApiResource, openapi_document
from zserve.frontends.prompt_blocks import PromptBlocks
from zserve.frontends.rerank_routes import RerankResource, ScoreResource, rerank_models
from zserve.frontends.resources import (
    Health,
    LiveResource,
    MetricsResource,
    ModelsResource,
    PredictResource,
    PredictRoute,
    ReadyResource,
    error_serializer,
)
from zserve.frontends.tokenize_routes import DetokenizeResource, TokenizeResource
from zserve.logs import setup_logging
from zserve.model import load_handler

log = logging.getLogger("zserve.frontend")


@dataclass(frozen=True)
class Frontend:
    """One worker's falcon app, and what the fast HTTP path beside it (``fast_http.py``) needs: the predict
    route's core and the API-key check (None: the API is open). Called, it is the app (ASGI)."""

    app: falcon.asgi.App
    predict: PredictRoute
    auth: RequireApiKey | None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


def create_app(settings: FrontendSettings | None = None) -> falcon.asgi.App:
    return create_frontend(settings).app


def create_frontend(settings: FrontendSettings | None = None) -> Frontend:
    if settings is None:
        raw = os.environ.get("ZSERVE_FRONTEND")
        if not raw:
            raise RuntimeError("ZSERVE_FRONTEND is not set: start frontends with `zserve up`")
        settings = msgspec.json.decode(raw, type=FrontendSettings)
        setup_logging(f"frontend-{os.environ.get('ZSERVE_FRONTEND_INDEX', os.getpid())}", always_name=True)
    # Constructors only: the request/response hooks need no weights (setup runs in engines).
    handlers = {m.name: load_handler(m.handler, m.options) for m in settings.models}
    # Models batched by cost: every request of every route carries its item's cost (Model.cost).
    cost_of = {m.name: handlers[m.name].cost for m in settings.models if m.max_batch_cost}
    # Each generative model's tokenizer (loaded on first use), for /tokenize and routing
    tokenizers = {m.name: ModelTokenizer(m.options) for m in settings.models if handlers[m.name].generative}
    # Generative models routed cache_aware: every request carries its prompt's block hashes (prompt_blocks.py)
    routed = [m for m in settings.models if m.route_blocks and handlers[m.name].generative]
    blocks_of = {m.name: PromptBlocks(m.options, tokenizers[m.name]).start() for m in routed}
    client = AsyncClient(settings.client_endpoint, cost_of=cost_of, blocks_of=blocks_of)
    health = Health(client)

    keys = api_keys_from(settings.api_keys_file)
    auth = RequireApiKey(keys, settings.auth_health, settings.probe_key) if keys.enabled else None
    middleware = [auth] if auth is not None else []
    app = falcon.asgi.App(cors_enable=False, middleware=middleware)
    app.req_options.auto_parse_form_urlencoded = False
    app.set_error_serializer(error_serializer)
    limits = Limits.from_settings(settings)
    body = settings.max_body_bytes
    predict = PredictRoute(client, handlers, body, limits)
    app.add_route("/v1/models/{name}/predict", PredictResource(predict))
    app.add_route("/v1/models", ModelsResource(handlers))
    if any(h.generative for h in handlers.values()):  # the same test as openapi_document's
        app.add_route("/v1/completions", CompletionsResource(client, handlers, body, limits))
        app.add_route("/v1/chat/completions", ChatCompletionsResource(client, handlers, body, limits))
        app.add_route("/mii/{deployment}", MiiResource(client, handlers, body, limits))
        app.add_route("/tokenize", TokenizeResource(tokenizers, body, limits))
        app.add_route("/detokenize", DetokenizeResource(tokenizers, body, limits))
    if embedding_models(handlers):
        app.add_route("/v1/embeddings", EmbeddingsResource(client, handlers, body, limits))
    if rerank_models(handlers):
        rerank = RerankResource(client, handlers, body, limits)
        app.add_route("/v1/rerank", rerank)
        app.add_route("/v2/rerank", rerank)  # Cohere's v2 path; the same body and answer
        app.add_route("/v1/score", ScoreResource(client, handlers, body, limits))
    app.add_route("/healthz", LiveResource())
    staged = [m.name for m in settings.models if m.preprocess]
    app.add_route("/readyz", ReadyResource(health, list(handlers), staged))
    app.add_route("/metrics", MetricsResource(health))
    generative = [name for name, h in handlers.items() if h.generative]
    document = openapi_document(list(handlers), generative, list(embedding_models(handlers)),
                                list(rerank_models(handlers)), keys.enabled, settings.auth_health)  # fmt: skip
    app.add_route("/openapi.json", OpenApiResource(document))
    log.info("frontend worker up (pid %d), models: %s, API keys %s", os.getpid(), ", ".join(handlers),
             "required" if keys.enabled else "off")  # fmt: skip
    return Frontend(app, predict, auth)

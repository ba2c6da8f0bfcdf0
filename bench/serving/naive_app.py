"""The naive baseline: the same models in a plain falcon ASGI app under gunicorn, no broker, no batching.

Every worker loads every model itself (``setup`` + ``warmup``) and each request runs
``preprocess`` + ``predict([item])`` right in the request handler, the way a model is usually first put behind HTTP. The
route and the request/response hooks are the same as zserve's, so the same wrk script drives both.

Started by bench/common/procs.py as ``gunicorn --worker-class asgi --pythonpath bench 'naive_app:create_app()'``;
settings come from the environment:

* NAIVE_CONFIG: the supervisor.toml the models' handlers and options come from (default: the repo's);
* NAIVE_MODELS: comma-separated model names;
* NAIVE_THREADS: torch intra-op threads per worker;
* NAIVE_READY_DIR: each worker drops ``<pid>.ready`` there once its models are loaded.
"""

from __future__ import annotations

import os
from pathlib import Path

import falcon
import falcon.asgi

from bench.common.catalog import DEFAULT_CONFIG
from bench.serving.same_model import decode_body, encode_error, encode_output, load_model, predict_items
from zserve.model import Model


def _error(resp: falcon.asgi.Response, status: int, message: str) -> None:
    resp.status = status
    resp.content_type = falcon.MEDIA_JSON
    resp.data = encode_error(message)


class Predict:
    def __init__(self, models: dict[str, Model]) -> None:
        self.models = models

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, name: str) -> None:
        model = self.models.get(name)
        if model is None:
            return _error(resp, 404, f"no model named {name!r}")
        try:
            item = decode_body(model, await req.stream.read())
        except Exception as exc:
            return _error(resp, 400, f"{type(exc).__name__}: {exc}")
        output = predict_items(model, [item])[0]  # blocks the event loop: that is the naive way
        resp.data = encode_output(model, output)
        resp.content_type = falcon.MEDIA_JSON


class Ready:
    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.media = {"status": "ready", "pid": os.getpid()}


def create_app() -> falcon.asgi.App:
    names = [n for n in os.environ.get("NAIVE_MODELS", "echo").split(",") if n]
    threads = int(os.environ.get("NAIVE_THREADS", "1"))
    config = os.environ.get("NAIVE_CONFIG", DEFAULT_CONFIG)
    models: dict[str, Model] = {name: load_model(config, name, threads) for name in names}
    app = falcon.asgi.App(cors_enable=False)
    app.add_route("/v1/models/{name}/predict", Predict(models))
    app.add_route("/readyz", Ready())
    ready_dir = os.environ.get("NAIVE_READY_DIR")
    if ready_dir:
        (Path(ready_dir) / f"{os.getpid()}.ready").write_text("ready\n")
    return app

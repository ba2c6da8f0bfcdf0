"""The naive baseline: the same models in a plain falcon ASGI app under gunicorn, no broker, no batching.

Every worker loads every model itself (``setup`` + ``warmup``) and each request runs
``preprocess`` + ``predict([item])`` right in the request handler, the way a model is usually first put behind HTTP. The
route and the request/response hooks are the same as zserve's, so the same wrk script drives both.

Started by bench/procs.py as ``gunicorn --worker-class asgi --pythonpath bench 'naive_app:create_app()'``;
settings come from the environment:

* NAIVE_CONFIG: the supervisor.toml the models' handlers and options come from (default: the repo's);
* NAIVE_MODELS: comma-separated model names;
* NAIVE_THREADS: torch intra-op threads per worker;
* NAIVE_READY_DIR: each worker drops ``<pid>.ready`` there once its models are loaded.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import falcon
import falcon.asgi
import msgspec

from catalog import DEFAULT_CONFIG
from zserve import payload
from zserve.config import load_config
from zserve.model import Model, load_handler, predict_inline, setup_inline

_json = msgspec.json.Encoder(enc_hook=payload.to_jsonable)


def _error(resp: falcon.asgi.Response, status: int, message: str) -> None:
    resp.status = status
    resp.content_type = falcon.MEDIA_JSON
    resp.data = _json.encode({"error": {"type": "error", "message": message}})


class Predict:
    def __init__(self, models: dict[str, Model]) -> None:
        self.models = models

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, name: str) -> None:
        model = self.models.get(name)
        if model is None:
            return _error(resp, 404, f"no model named {name!r}")
        try:
            item = model.decode_request(msgspec.json.decode(await req.stream.read()))
        except Exception as exc:
            return _error(resp, 400, f"{type(exc).__name__}: {exc}")
        output = predict_inline(model, [item])[0]  # blocks the event loop: that is the naive way
        resp.data = _json.encode(model.encode_response(output))
        resp.content_type = falcon.MEDIA_JSON


class Ready:
    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.media = {"status": "ready", "pid": os.getpid()}


def load_models(names: list[str], threads: int, config_path: str | Path) -> dict[str, Model]:
    config = load_config(config_path)
    models = {}
    for name in names:
        spec = config.model(name)
        model = load_handler(spec.handler, spec.options)
        setup_inline(model)
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(threads)
        models[name] = model
    return models


def create_app() -> falcon.asgi.App:
    names = [n for n in os.environ.get("NAIVE_MODELS", "echo").split(",") if n]
    models = load_models(
        names, int(os.environ.get("NAIVE_THREADS", "1")), os.environ.get("NAIVE_CONFIG", DEFAULT_CONFIG)
    )
    app = falcon.asgi.App(cors_enable=False)
    app.add_route("/v1/models/{name}/predict", Predict(models))
    app.add_route("/readyz", Ready())
    ready_dir = os.environ.get("NAIVE_READY_DIR")
    if ready_dir:
        (Path(ready_dir) / f"{os.getpid()}.ready").write_text("ready\n")
    return app

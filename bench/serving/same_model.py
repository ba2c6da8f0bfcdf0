"""The one model code every non-zserve target runs (naive server, mosec, service-streamer, in-process limit's
hooks): the deployment's handler, loaded and warmed up in this process, with zserve's own request and
response hooks and msgspec JSON on both sides. So a target differs from zserve only in how it serves.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import msgspec

from zserve import payload
from zserve.config import load_config
from zserve.model import Model, load_handler, predict_inline, setup_inline

_encoder = msgspec.json.Encoder(enc_hook=payload.to_jsonable)
_decoder = msgspec.json.Decoder()


def load_model(config_path: str | Path, name: str, threads: int) -> Model:
    """The model ``name`` of the deployment, set up and warmed up here, torch on ``threads`` intra-op threads."""
    spec = load_config(config_path).model(name)
    model = load_handler(spec.handler, spec.options)
    setup_inline(model)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
    return model


def decode_body(model: Model, body: bytes) -> Any:
    """A request body (JSON bytes) as one batch item; raises on bad JSON or what ``decode_request`` rejects."""
    return model.decode_request(_decoder.decode(body))


def predict_items(model: Model, items: list[Any]) -> list[Any]:
    """``preprocess`` + ``predict`` on a batch of items, as a zserve stage and engine do together."""
    return predict_inline(model, items)


def encode_output(model: Model, output: Any) -> bytes:
    """One output as its response body (JSON bytes)."""
    return _encoder.encode(model.encode_response(output))


def encode_error(message: str) -> bytes:
    return _encoder.encode({"error": {"type": "error", "message": message}})

"""The mosec 0.9.8 target: the same models behind mosec's Rust HTTP server and its Python worker processes,
with its dynamic batching (one worker per model, the deployment's ``max_batch_size`` and ``max_wait_ms``).

Run by bench/serving/peers.py as ``python -m bench.serving.peer_mosec --address 127.0.0.1 --port P --timeout MS
--capacity N`` (mosec's own command line); which models, and their settings, come from the environment:

* PEER_CONFIG: the supervisor.toml the models' handlers, options, batch sizes and waits come from;
* PEER_MODELS: comma-separated model names, each served at ``POST /v1/models/NAME/predict`` (zserve's route,
  so the same wrk script drives every target);
* PEER_THREADS: torch intra-op threads per worker.

Each request body goes through the same hooks as in zserve (``decode_request``, ``preprocess`` + ``predict`` on
the batch, ``encode_response``), with msgspec JSON; see bench/serving/same_model.py.
"""

from __future__ import annotations

import os
from typing import Any

from mosec import Server, ValidationError, Worker

from bench.serving.same_model import decode_body, encode_output, load_model, predict_items
from zserve.config import load_config


class ModelWorker(Worker):
    """One model in one mosec worker process (mosec constructs it there: spawn)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = load_model(os.environ["PEER_CONFIG"], os.environ["PEER_MODEL"], int(os.environ["PEER_THREADS"]))

    def deserialize(self, data: bytes) -> Any:
        try:
            return decode_body(self.model, data)
        except Exception as exc:
            raise ValidationError(f"{type(exc).__name__}: {exc}") from exc

    def forward(self, data: list[Any]) -> list[Any]:
        return predict_items(self.model, data)

    def serialize(self, data: Any) -> bytes:
        return encode_output(self.model, data)


def main() -> None:
    config = load_config(os.environ["PEER_CONFIG"])
    server = Server()
    for name in [n for n in os.environ["PEER_MODELS"].split(",") if n]:
        spec = config.model(name)
        server.append_worker(
            ModelWorker,
            num=1,
            max_batch_size=spec.max_batch_size,
            max_wait_time=max(1, round(spec.max_wait_ms)),  # whole ms; mosec reads 0 as "the --wait default"
            env=[{"PEER_MODEL": name}],
            route=f"/v1/models/{name}/predict",
        )
    server.run()


if __name__ == "__main__":
    main()

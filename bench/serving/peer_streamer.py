"""The service-streamer 0.1.2 target, multiprocess mode, served as its docs serve it
(example/flask_multigpu_example.py): a Flask app under gevent's WSGIServer, one ``Streamer`` per model (a
spawned worker process holding the model, batches up to the deployment's ``max_batch_size``, waiting at most
its ``max_wait_ms`` for a batch to fill).

Run by bench/serving/peers.py as ``python -m bench.serving.peer_streamer --port P``; settings from the environment
(PEER_CONFIG, PEER_MODELS, PEER_THREADS, as for bench/serving/peer_mosec.py). Prints ``peer ready`` once every
worker has answered a request. Each model's hooks are zserve's (bench/serving/same_model.py): ``decode_request``
in the web process, ``preprocess`` + ``predict`` on the batch in the worker, ``encode_response`` in the web process.
"""

# gevent must patch the standard library before anything else imports it (as the example does).
from gevent import monkey

monkey.patch_all()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
from typing import Any  # noqa: E402

from flask import Flask, Response, request  # noqa: E402
from gevent.pywsgi import WSGIServer  # noqa: E402
from service_streamer import ManagedModel, Streamer  # noqa: E402

from bench.common.catalog import BODIES  # noqa: E402
from bench.serving.same_model import decode_body, encode_error, encode_output, load_model, predict_items  # noqa: E402
from zserve.config import load_config  # noqa: E402
from zserve.model import Model, load_handler  # noqa: E402

READY_ATTEMPTS = 60  # each waits up to service-streamer's own 20 s result timeout: a slow first load is fine


class StreamedModel(ManagedModel):
    """The model inside a Streamer's worker process (service-streamer constructs it there)."""

    def init_model(self, config_path: str, name: str, threads: int) -> None:
        self.model = load_model(config_path, name, threads)

    def predict(self, batch: list[Any]) -> list[Any]:
        return predict_items(self.model, batch)


def create_app(hooks: dict[str, Model], streamers: dict[str, Streamer]) -> Flask:
    app = Flask(__name__)

    @app.post("/v1/models/<name>/predict")
    def predict(name: str) -> Response:
        model, streamer = hooks.get(name), streamers.get(name)
        if model is None or streamer is None:
            return Response(encode_error(f"no model named {name!r}"), status=404, mimetype="application/json")
        try:
            item = decode_body(model, request.get_data())
        except Exception as exc:
            return Response(encode_error(f"{type(exc).__name__}: {exc}"), status=400, mimetype="application/json")
        output = streamer.predict([item])[0]
        return Response(encode_output(model, output), mimetype="application/json")

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    config_path, threads = os.environ["PEER_CONFIG"], int(os.environ["PEER_THREADS"])
    config = load_config(config_path)
    hooks: dict[str, Model] = {}
    streamers: dict[str, Streamer] = {}
    for name in [n for n in os.environ["PEER_MODELS"].split(",") if n]:
        spec = config.model(name)
        hooks[name] = load_handler(spec.handler, spec.options)  # request/response hooks only: no weights here
        streamers[name] = Streamer(StreamedModel, batch_size=spec.max_batch_size, max_latency=spec.max_wait_ms / 1000,
                                   worker_num=1, model_init_args=(config_path, name, threads))  # fmt: skip
        probe = decode_body(hooks[name], json.dumps(BODIES[spec.handler]).encode())
        for attempt in range(READY_ATTEMPTS):
            try:
                streamers[name].predict([probe])
                break
            except TimeoutError:
                if attempt == READY_ATTEMPTS - 1:
                    raise
    print("peer ready", flush=True)
    WSGIServer(_listener(args.port), create_app(hooks, streamers), log=None).serve_forever()


def _listener(port: int) -> socket.socket:
    """A listening socket with TCP_NODELAY, which accepted connections inherit. gevent's server writes the
    headers and the body of a response in two sends; with Nagle's algorithm on, a keep-alive client's delayed
    ACK then holds every response ~40 ms. That is a setting any deployment would fix, not the peer's cost."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(1024)
    return sock


if __name__ == "__main__":
    main()

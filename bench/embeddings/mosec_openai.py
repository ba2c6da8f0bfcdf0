"""mosec 0.9.8 serving zserve's embedding handler at an OpenAI-shaped route of its own: ``POST /embeddings`` with
``{"model": NAME, "input": "TEXT"}``, answered ``{"object": "list", "data": [{"object": "embedding", "index": 0,
"embedding": [...]}], "model": NAME, "usage": {...}}``, so that the same wrk script drives zserve, infinity and mosec.

One worker process (mosec spawns it) runs the handler's ``preprocess`` (tokenization) and ``predict`` on mosec's
dynamic batches. Run by run.py as ``python -m bench.embeddings.mosec_openai --address 127.0.0.1 --port P --timeout MS
--capacity N`` (mosec's own command line); settings from the environment:

* PEER_MODEL_DIR, PEER_MODEL_NAME: the model folder and the name requests must give;
* PEER_THREADS: torch intra-op threads of the worker;
* PEER_MAX_BATCH, PEER_MAX_WAIT_MS: mosec's ``max_batch_size`` and ``max_wait_time``;
* PEER_STATS (optional): a file the worker rewrites after every batch with ``batches items real_tokens
  padded_tokens`` (cumulative), from which run.py reads the batch sizes and padding efficiency of a run.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec
from mosec import Server, ValidationError, Worker

from bench.embeddings import embed_model

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


class EmbedWorker(Worker):
    def __init__(self) -> None:
        super().__init__()
        self.name = os.environ["PEER_MODEL_NAME"]
        self.model = embed_model.load(os.environ["PEER_MODEL_DIR"], int(os.environ["PEER_THREADS"]))
        self.stats_path = os.environ.get("PEER_STATS", "")
        self.totals = [0, 0, 0, 0]  # batches, items, real tokens, padded tokens

    def deserialize(self, data: bytes) -> Any:
        try:
            body = _decoder.decode(data)
            if not isinstance(body, dict) or body.get("model") != self.name or not isinstance(body.get("input"), str):
                raise ValueError(f'the body must be {{"model": "{self.name}", "input": "TEXT"}}')
            return embed_model.items(self.model, [body["input"]])[0]
        except Exception as exc:
            raise ValidationError(f"{type(exc).__name__}: {exc}") from exc

    def forward(self, data: list[Any]) -> list[Any]:
        features = embed_model.preprocess(self.model, data)
        real, padded = embed_model.padding(features)
        outputs = self.model.predict(features)
        if self.stats_path:
            t = self.totals
            t[0], t[1], t[2], t[3] = t[0] + 1, t[1] + len(data), t[2] + real, t[3] + padded
            tmp = f"{self.stats_path}.tmp"
            with open(tmp, "w") as f:
                f.write(" ".join(map(str, t)))
            os.replace(tmp, self.stats_path)
        return [(embed_model.vector(o), o.get("tokens", 0) if isinstance(o, dict) else 0) for o in outputs]

    def serialize(self, data: Any) -> bytes:
        vector, tokens = data
        return _encoder.encode({
            "object": "list",
            "data": [{"object": "embedding", "index": 0, "embedding": vector.tolist()}],
            "model": self.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        })  # fmt: skip


def main() -> None:
    server = Server()
    server.append_worker(
        EmbedWorker,
        num=1,
        max_batch_size=int(os.environ.get("PEER_MAX_BATCH", "32")),
        max_wait_time=max(1, int(os.environ.get("PEER_MAX_WAIT_MS", "5"))),  # whole ms; 0 means mosec's default
        route="/embeddings",
    )
    server.run()


if __name__ == "__main__":
    main()

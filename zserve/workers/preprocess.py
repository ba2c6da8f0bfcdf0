"""A preprocess stage process: CPU work (tokenising, decoding images) on whole batches, beside the engines.

``python -m zserve.workers.preprocess --name stage-minilm-0 --model-json '{...}' --work-endpoint ...
--out-endpoint ...``. Started by the supervisor for every model that overrides ``preprocess``; it runs
``setup_preprocess`` (never ``setup``: no weights here), registers with the broker exactly like an engine
(role "preprocess"), and for each batch runs ``decode_request`` (for direct clients' items) and
``preprocess`` on the items, returning one payload (arrays as raw frames) that the broker hands to an
engine. An exception in ``preprocess`` answers that batch's requests with a 400-class error naming this
stage; the stage keeps serving.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from zserve import payload
from zserve.hooks import check_preprocess_hooks
from zserve.model import Model
from zserve.protocol import Batch, BatchResult, Status
from zserve.workers.items import Failure, ResultBuilder, decode_items
from zserve.workers.runtime import run_worker

log = logging.getLogger("zserve.preprocess")


class PreprocessRunner:
    """Runs one Batch through decode_request and preprocess. No sockets: tested directly."""

    def __init__(self, model: Model, worker_id: str) -> None:
        self.model = model
        self.worker_id = worker_id

    def run(self, batch: Batch, frames: list[Any]) -> tuple[BatchResult, list[Any]]:
        started = time.perf_counter()
        values, _, outcomes = decode_items(self.model, batch, frames)
        prepared: list[Any] = []
        if values:
            try:
                prepared = payload.encode(self.model.preprocess(values))
            except Exception as exc:
                log.warning("batch %d: preprocess raised %s: %s", batch.batch_id, type(exc).__name__, exc)
                failure = Failure.from_exception(exc, Status.BAD_REQUEST, "preprocess")
                failure.message = f"preprocess stage {self.worker_id}: {failure.message}"
                outcomes = [o or failure for o in outcomes]
        result = ResultBuilder()
        for outcome in outcomes:
            if isinstance(outcome, Failure):
                result.failed(outcome)
            else:
                result.ok([])  # its data is in the prepared payload
        compute_ms = (time.perf_counter() - started) * 1000.0
        return result.build(batch.batch_id, self.worker_id, compute_ms, prepared)


def start_stage(model: Model, device: str) -> None:
    check_preprocess_hooks(type(model))
    model.setup_preprocess()


def main(argv: list[str] | None = None) -> int:
    return run_worker(
        "preprocess", __doc__, start_stage, lambda model, link: PreprocessRunner(model, link.worker_id), argv
    )


if __name__ == "__main__":
    sys.exit(main())

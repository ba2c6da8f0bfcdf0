"""An engine process: loads one model on one device, then runs the batches the broker sends it.

``python -m zserve.stages.engine --name engine-echo-0 --model-json '{...}' --work-endpoint ...
--out-endpoint ... [--device cpu]``. Started by the supervisor; every argument comes from it.

Failure isolation: an item that fails to decode, or whose output is an exception, fails alone. If
``predict`` raises on a batch of several items, each item is retried alone, so one bad item never fails
its batch-mates. A ``predict`` that returns the wrong number of outputs fails the whole batch (there is no
telling which output belongs to whom), and so does one that raises on a preprocessed batch (a stage made
it into one payload: it cannot be split). The engine keeps serving after all of these.
"""

from __future__ import annotations

import logging
import sys
import time
import traceback
from typing import Any

from zserve import payload
from zserve.errors import BadRequest
from zserve.model import Model
from zserve.protocol import Batch, BatchResult, Status
from zserve.stages.items import Failure, ResultBuilder, decode_items
from zserve.stages.runtime import WorkerLink, run_worker

log = logging.getLogger("zserve.engine")


class BatchRunner:
    """Runs one Batch through a model's hooks. No sockets: tested directly."""

    def __init__(self, model: Model, worker_id: str) -> None:
        self.model = model
        self.worker_id = worker_id

    def _predict(self, batch: Any, n: int, splittable: bool) -> list[Any]:
        """One output (or exception) per item."""
        try:
            outputs = self.model.predict(batch)
        except Exception as exc:
            if n == 1 or not splittable:
                return [exc] * n
            log.warning("predict raised %s on a batch of %d; retrying each item alone", type(exc).__name__, n)
            return [self._predict([item], 1, True)[0] for item in batch]
        if not isinstance(outputs, list | tuple) or len(outputs) != n:
            count = len(outputs) if isinstance(outputs, list | tuple) else type(outputs).__name__
            return [RuntimeError(f"predict returned {count} outputs for a batch of {n}")] * n
        return list(outputs)

    def run(self, batch: Batch, frames: list[Any]) -> tuple[BatchResult, list[Any]]:
        started = time.perf_counter()
        n = len(batch.item_ids)
        if batch.prepared:
            outcomes: list[Any] = [None] * n
            try:
                outputs = self._predict(payload.decode(frames), n, splittable=False)
            except payload.PayloadError as exc:
                outputs = [exc] * n
            positions = list(range(n))
        else:
            values, positions, outcomes = decode_items(self.model, batch, frames)
            outputs = self._predict(values, len(values), splittable=True) if values else []
        for i, output in zip(positions, outputs, strict=True):
            if isinstance(output, BaseException):
                outcomes[i] = Failure.from_exception(output, Status.INTERNAL, "predict")
                if not isinstance(output, BadRequest):
                    why = "".join(traceback.format_exception_only(output)).strip()
                    log.error("batch %d item %d: %s", batch.batch_id, batch.item_ids[i], why)
            else:
                outcomes[i] = output
        result = ResultBuilder()
        for i, outcome in enumerate(outcomes):
            if isinstance(outcome, Failure):
                result.failed(outcome)
                continue
            try:
                value = outcome if batch.decoded[i] else self.model.encode_response(outcome)
                result.ok(payload.encode(value))
            except Exception as exc:
                result.failed(Failure.from_exception(exc, Status.INTERNAL, "encode_response"))
        return result.build(batch.batch_id, self.worker_id, (time.perf_counter() - started) * 1000.0)


def start_engine(model: Model, device: str) -> None:
    model.setup(device)
    model.warmup()


def make_runner(model: Model, link: WorkerLink) -> Any:
    """Batch models run batch by batch; generative models run sequences, every step, on the engine core."""
    if model.generative:
        from zserve.stages.generate.runner import GenerationRunner

        return GenerationRunner(model, link)
    return BatchRunner(model, link.worker_id)


def main(argv: list[str] | None = None) -> int:
    return run_worker("engine", __doc__, start_engine, make_runner, argv)


if __name__ == "__main__":
    sys.exit(main())

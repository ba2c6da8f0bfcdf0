"""An engine process: loads one model on one device, then runs the batches the broker sends it.

``python -m zserve.workers.engine --name engine-echo-0 --model-json '{...}' --work-endpoint ...
--out-endpoint ... [--device cpu]``. Started by the supervisor; every argument comes from it.

Failure isolation: an item that fails to decode, or whose output is an exception, fails alone. If
``predict`` raises on a batch of several items, each item is retried alone, so one bad item never fails
its batch-mates. A ``predict`` that returns the wrong number of outputs fails the whole batch (there is no
telling which output belongs to whom), and so does one that raises on a preprocessed batch (a stage made
it into one payload: it cannot be split). The engine keeps serving after all of these.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import zmq

from zserve import payload
from zserve.errors import BadRequest
from zserve.frames import pack
from zserve.hooks import check_preprocess_hooks
from zserve.model import Model, uses_preprocess
from zserve.protocol import Batch, BatchResult, Codec, Status
from zserve.transport import make_socket
from zserve.workers.items import Failure, ResultBuilder, decode_items
from zserve.workers.runtime import WorkerLink, enter_compute_thread, run_worker

log = logging.getLogger("zserve.engine")


@dataclass(slots=True)
class Job:
    """A batch between the engine's threads: decoded inputs in, outcomes (outputs or Failures) out."""

    batch: Batch
    values: list[Any]  # predict's input: the decoded items, or a stage's prepared payload
    positions: list[int]  # where each value's output goes in ``outcomes``
    outcomes: list[Any]  # per item of the batch: None (pending), an output, or a Failure
    compute_ms: float = 0.0  # predict's time: what the broker adds up as the engine's busy time


class BatchSteps:
    """Runs Batches through a model's hooks in three steps, so that an engine can run them on different
    threads: ``decode`` (payloads, ``decode_request``), ``compute`` (``predict``), ``encode``
    (``encode_response``, payloads, the BatchResult). ``run`` does all three in a row. No sockets."""

    def __init__(self, model: Model, worker_id: str) -> None:
        self.model = model
        self.worker_id = worker_id

    def run(self, batch: Batch, frames: list[Any]) -> tuple[BatchResult, list[Any]]:
        job = self.decode(batch, frames)
        self.compute(job)
        return self.encode(job)

    def decode(self, batch: Batch, frames: list[Any]) -> Job:
        n = len(batch.item_ids)
        if batch.preprocess:  # a stage's work, done here: the engine was idle (see zserve.protocol.Batch)
            return self._preprocessed(Job(batch, *decode_items(self.model, batch, frames)))
        if not batch.prepared:
            return Job(batch, *decode_items(self.model, batch, frames))
        try:
            value = payload.decode(frames)
        except payload.PayloadError as exc:
            return Job(batch, [], [], [Failure.from_exception(exc, Status.INTERNAL, "payload")] * n)
        return Job(batch, value, list(range(n)), [None] * n)

    def _preprocessed(self, job: Job) -> Job:
        """``preprocess`` on the decoded items, as a stage runs it: if it raises, every item fails with it."""
        if job.positions:
            try:
                job.values = self.model.preprocess(job.values)
            except Exception as exc:
                log.warning("batch %d: preprocess raised %s: %s", job.batch.batch_id, type(exc).__name__, exc)
                failure = Failure.from_exception(exc, Status.BAD_REQUEST, "preprocess")
                job.outcomes = [o or failure for o in job.outcomes]
                job.values, job.positions = [], []
        return job

    def compute(self, job: Job) -> None:
        if job.positions:
            t0 = time.perf_counter()
            splittable = not (job.batch.prepared or job.batch.preprocess)  # one payload: it cannot be split
            outputs = self._predict(job.values, len(job.positions), splittable=splittable)
            job.compute_ms = (time.perf_counter() - t0) * 1000.0
            for i, output in zip(job.positions, outputs, strict=True):
                if isinstance(output, BaseException):
                    job.outcomes[i] = Failure.from_exception(output, Status.INTERNAL, "predict")
                    if not isinstance(output, BadRequest):
                        why = "".join(traceback.format_exception_only(output)).strip()
                        log.error("batch %d item %d: %s", job.batch.batch_id, job.batch.item_ids[i], why)
                else:
                    job.outcomes[i] = output
        job.values = []  # the inputs may hold large arrays: let them go before the encode

    def encode(self, job: Job) -> tuple[BatchResult, list[Any]]:
        result = ResultBuilder()
        for outcome, decoded in zip(job.outcomes, job.batch.decoded, strict=True):
            if isinstance(outcome, Failure):
                result.failed(outcome)
                continue
            try:
                result.ok(payload.encode(outcome if decoded else self.model.encode_response(outcome)))
            except Exception as exc:
                result.failed(Failure.from_exception(exc, Status.INTERNAL, "encode_response"))
        return result.build(job.batch.batch_id, self.worker_id, job.compute_ms)

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


class BatchRunner:
    """The batch engine process's runner, on three threads (docs/architecture.md): the link's thread (it owns
    the DEALER) decodes each Batch as it arrives; the compute thread only runs ``predict``; the output thread
    encodes and sends results on its own PUSH. With credits >= 2 the next batch is decoded and the last one
    encoded and sent while ``predict`` runs, so the device never waits for serialisation."""

    def __init__(self, model: Model, link: WorkerLink) -> None:
        self.steps = BatchSteps(model, link.worker_id)
        self.link = link
        self._inbox: queue.SimpleQueue[Job | None] = queue.SimpleQueue()  # -> compute thread
        self._outbox: queue.SimpleQueue[Job | None] = queue.SimpleQueue()  # -> output thread
        self._ctx = zmq.Context()  # the output thread's own: the link's is terminated when serve returns
        self._threads = [
            threading.Thread(target=link.guarded(self._compute_loop), name="engine-compute", daemon=True),
            threading.Thread(target=link.guarded(self._output_loop), name="engine-output", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def run(self, batch: Batch, frames: list[Any]) -> None:
        """On the link's thread: decode, hand over. The answer goes out from the output thread."""
        self._inbox.put(self.steps.decode(batch, frames))

    def close(self) -> None:
        """Finish the batches held (the broker waits for them while draining), then stop."""
        compute, output = self._threads
        self._inbox.put(None)
        compute.join(timeout=30)
        self._outbox.put(None)
        output.join(timeout=5)
        if not output.is_alive():
            self._ctx.term()  # else it is stuck sending to a broker that is gone: exit without waiting

    def _compute_loop(self) -> None:
        enter_compute_thread(self.link.threads)
        while (job := self._inbox.get()) is not None:
            self.link.busy = True
            try:
                self.steps.compute(job)
            finally:
                self.link.busy = False
            self._outbox.put(job)

    def _output_loop(self) -> None:
        codec = Codec()
        push = make_socket(self._ctx, zmq.PUSH, self.link.out_endpoint, bind=False, linger_ms=2000)
        push.setsockopt(zmq.SNDTIMEO, 30_000)  # a broker gone for good must not hold the process forever
        try:
            while (job := self._outbox.get()) is not None:
                result, frames = self.steps.encode(job)
                push.send_multipart([codec.encode(result), *pack(frames)], copy=False)
        finally:
            push.close(linger=2000)


def preprocesses_when_idle(model: Model) -> bool:
    """Whether this engine takes its staged model's batches unpreprocessed while it is idle."""
    return uses_preprocess(type(model)) and model.preprocess_in_idle_engine


def start_engine(model: Model, device: str) -> None:
    if preprocesses_when_idle(model):
        check_preprocess_hooks(type(model))
        model.setup_preprocess()
    model.setup(device)
    model.warmup()


def make_runner(model: Model, link: WorkerLink) -> Any:
    """Batch models run batch by batch; generative models run sequences, every step, on the engine core."""
    if model.generative:
        from zserve.workers.generate.runner import GenerationRunner

        return GenerationRunner(model, link)
    link.preprocesses = preprocesses_when_idle(model)
    return BatchRunner(model, link)


def main(argv: list[str] | None = None) -> int:
    return run_worker("engine", __doc__, start_engine, make_runner, argv, computes_on_thread=True)


if __name__ == "__main__":
    sys.exit(main())

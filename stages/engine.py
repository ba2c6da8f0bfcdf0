"""An engine process: loads one model on one device, then runs the batches the broker sends it.

``python -m zserve.stages.engine --name engine-echo-0 --model-json '{...}' --work-endpoint ...
--out-endpoint ... [--device cpu]``. Started by the supervisor; every argument comes from it.

Failure isolation: an item that fails to decode, or whose output is an exception, fails alone. If
``predict`` raises on a batch of several items, each item is retried alone, so one bad item never fails
its batch-mates. A ``predict`` that returns the wrong number of outputs fails the whole batch (there is no
telling which output belongs to whom). The engine keeps serving after all of these.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import traceback
from typing import Any

import msgspec
from zserve.stages.runtime import WorkerLink

from zserve import payload
from zserve.config import ModelConfig
from zserve.errors import BadRequest, ZserveError
from zserve.logs import setup_logging
from zserve.model import Model, load_handler
from zserve.protocol import Batch, BatchResult, Status
from zserve.transport import die_with_parent

log = logging.getLogger("zserve.engine")


class _Failure:
    """One item's failure: a status and what to tell the client."""

    __slots__ = ("field", "message", "status")

    def __init__(self, status: Status, message: str, field: str = "") -> None:
        self.status = status
        self.message = message
        self.field = field

    @classmethod
    def from_exception(cls, exc: BaseException, default: Status, where: str) -> _Failure:
        if isinstance(exc, ZserveError):
            return cls(exc.status, exc.message or str(exc), exc.field)
        return cls(default, f"{where} raised {type(exc).__name__}: {exc}")


class BatchRunner:
    """Runs one Batch through a model's hooks. No sockets: tested directly."""

    def __init__(self, model: Model, worker_id: str) -> None:
        self.model = model
        self.worker_id = worker_id

    def _predict(self, items: list[Any]) -> list[Any]:
        """One output (or exception) per item."""
        try:
            outputs = self.model.predict(items)
        except Exception as exc:
            if len(items) == 1:
                return [exc]
            log.warning("predict raised %s on a batch of %d; retrying each item alone", type(exc).__name__, len(items))
            return [self._predict([item])[0] for item in items]
        if not isinstance(outputs, list | tuple) or len(outputs) != len(items):
            n = len(outputs) if isinstance(outputs, list | tuple) else type(outputs).__name__
            error = RuntimeError(f"predict returned {n} outputs for a batch of {len(items)}")
            return [error] * len(items)
        return list(outputs)

    def run(self, batch: Batch, frames: list[Any]) -> tuple[BatchResult, list[Any]]:
        started = time.perf_counter()
        n = len(batch.item_ids)
        results: list[Any] = [None] * n  # an output, or a _Failure
        items: list[Any] = []
        positions: list[int] = []
        offset = 0
        for i, (count, decoded) in enumerate(zip(batch.frame_counts, batch.decoded, strict=True)):
            item_frames = frames[offset : offset + count]
            offset += count
            try:
                value = payload.decode(item_frames)
                if not decoded:
                    value = self.model.decode_request(value)
            except Exception as exc:
                results[i] = _Failure.from_exception(exc, Status.BAD_REQUEST, "decode_request")
                continue
            items.append(value)
            positions.append(i)
        if items:
            for i, output in zip(positions, self._predict(items), strict=True):
                if isinstance(output, BaseException):
                    results[i] = _Failure.from_exception(output, Status.INTERNAL, "predict")
                    if not isinstance(output, BadRequest):
                        log.error(
                            "batch %d item %d: %s",
                            batch.batch_id,
                            batch.item_ids[i],
                            "".join(traceback.format_exception_only(output)).strip(),
                        )
                else:
                    results[i] = output
        statuses, messages, fields, counts, out_frames = [], [], [], [], []
        for i, result in enumerate(results):
            if not isinstance(result, _Failure):
                try:
                    value = result if batch.decoded[i] else self.model.encode_response(result)
                    encoded = payload.encode(value)
                except Exception as exc:
                    result = _Failure.from_exception(exc, Status.INTERNAL, "encode_response")
                else:
                    statuses.append(Status.OK)
                    messages.append("")
                    fields.append("")
                    counts.append(len(encoded))
                    out_frames.extend(encoded)
                    continue
            statuses.append(result.status)
            messages.append(result.message)
            fields.append(result.field)
            counts.append(0)
        compute_ms = (time.perf_counter() - started) * 1000.0
        header = BatchResult(batch.batch_id, self.worker_id, statuses, messages, fields, counts, compute_ms)
        return header, out_frames


def _set_threads(threads: int) -> None:
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, str(threads))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zserve.stages.engine", description=__doc__)
    parser.add_argument("--name", required=True, help="process name, e.g. engine-echo-0")
    parser.add_argument("--model-json", required=True, help="the model's [[models]] table as JSON")
    parser.add_argument("--work-endpoint", required=True)
    parser.add_argument("--out-endpoint", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--heartbeat-interval-ms", type=int, default=250)
    parser.add_argument("--heartbeat-liveness", type=int, default=4)
    args = parser.parse_args(argv)

    setup_logging(args.name)
    die_with_parent()
    try:
        config = msgspec.json.decode(args.model_json, type=ModelConfig)
    except msgspec.ValidationError as exc:
        log.error("bad --model-json: %s", exc)
        return 2
    _set_threads(config.threads)
    link = WorkerLink(
        name=args.name,
        role="engine",
        models=[config.name],
        credits=config.credits,
        work_endpoint=args.work_endpoint,
        out_endpoint=args.out_endpoint,
        heartbeat_interval_ms=args.heartbeat_interval_ms,
        heartbeat_liveness=args.heartbeat_liveness,
    )
    link.install_signal_handlers()

    started = time.monotonic()
    log.info("loading model %s (%s) on %s, %d thread(s)", config.name, config.handler, args.device, config.threads)
    model = load_handler(config.handler, config.options)
    model.setup(args.device)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(config.threads)
    model.warmup()
    log.info("model %s ready after %.1fs", config.name, time.monotonic() - started)
    if link.stop.is_set():
        return 0
    link.serve(BatchRunner(model, link.worker_id).run)
    log.info("%s exiting", args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())

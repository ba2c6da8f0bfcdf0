"""Workers' results, for the broker core (a job split out of ``core.py``, working through the core's public
collaborators: the worker pool, the request table, the scheduler, the per-model stats and the outbox): an
engine's BatchResult answers its items, a preprocess stage's queues a prepared batch for the engines, a
generative engine's StepOutput streams text and answers finished sequences. Pure, like the core.

Multi-item messages from workers are length-checked: items a worker did not account for (too few statuses,
too few frames) are answered INTERNAL at once, never left to time out.
"""

from __future__ import annotations

import logging
from typing import Any

from zserve.batching.scheduler import Scheduler
from zserve.batching.workers import ENGINE, PREPROCESS, InFlightBatch, WorkerPool
from zserve.broker.outbox import Outbox
from zserve.broker.requests import RequestTable
from zserve.broker.stats import ModelStats
from zserve.protocol import Abort, BatchResult, Chunk, Reply, Status, StepOutput

log = logging.getLogger("zserve.broker")


class Results:
    """Handles what workers send back; answers leave through ``outbox``. Also keeps the compute time workers
    report (``busy_s``, for the health report)."""

    def __init__(
        self,
        pool: WorkerPool,
        requests: RequestTable,
        scheduler: Scheduler,
        stats: dict[str, ModelStats],
        outbox: Outbox,
    ) -> None:
        self.pool = pool
        self.requests = requests
        self.scheduler = scheduler
        self.stats = stats
        self.outbox = outbox
        self.busy_s: dict[tuple[str, str], float] = {}  # (model, role) -> compute time reported by workers

    def _add_busy(self, model: str, role: str, ms: float) -> None:
        key = (model, role)
        self.busy_s[key] = self.busy_s.get(key, 0.0) + ms / 1000.0

    def on_result(self, msg: BatchResult, frames: list[Any], now: float) -> None:
        batch = self.pool.finish(msg.batch_id)
        if batch is None:
            log.info("dropped late result of batch %d from %s", msg.batch_id, msg.worker)
            return
        self._add_busy(batch.model, batch.role, msg.compute_ms)
        self.pool.progressed(batch.worker_id, now)
        n = len(batch.item_ids)
        if batch.role == ENGINE:
            self.stats[batch.model].batch_done(n, msg.compute_ms / 1000.0, self.pool.ready_count(batch.model))
            if _accounts_for(n, len(frames), msg):
                return self._answer_batch(batch, msg, frames, now)
        payload_frames = len(frames) - msg.prepared_frames if batch.role == PREPROCESS else len(frames)
        rows, missing = _rows(n, payload_frames, msg.statuses, msg.messages, msg.fields, msg.frame_counts)
        if missing:
            why = "batch %d from %s accounts for %d of its %d items: the rest fail"
            log.error(why, msg.batch_id, msg.worker, n - missing, n)
        if batch.role == PREPROCESS:
            return self._on_preprocessed(batch, msg, frames, rows)
        for item_id, row in zip(batch.item_ids, rows, strict=True):
            request = self.requests.get(item_id)
            if request is None or request.batch_id != msg.batch_id:
                continue  # answered already (deadline, cancel)
            if row is None:
                self.outbox.reply(request, Status.INTERNAL, f"worker {msg.worker} returned no result for this item")
            else:
                status, message, field_name, start, stop = row
                queue_ms = (request.dispatched_s - request.arrived_s) * 1000.0
                fields = {"field": field_name, "batch_size": n, "queue_ms": queue_ms, "compute_ms": msg.compute_ms}
                self.outbox.reply(request, status, message, frames[start:stop], **fields)

    def _answer_batch(self, batch: InFlightBatch, msg: BatchResult, frames: list[Any], now: float) -> None:
        """The hot path of every result: an engine's BatchResult that accounts for every item."""
        answered = self.stats[batch.model].latencies_s.append
        by_id = self.requests.by_id
        pop = self.requests.pop
        to_clients = self.outbox.clients
        batch_id, size, compute_ms = msg.batch_id, len(batch.item_ids), msg.compute_ms
        offset = 0
        for item_id, status, message, field_name, count in zip(
            batch.item_ids, msg.statuses, msg.messages, msg.fields, msg.frame_counts, strict=True
        ):
            start = offset
            offset += count
            request = by_id.get(item_id)
            if request is None or request.batch_id != batch_id:
                continue  # answered already (deadline, cancel)
            pop(item_id)
            answered(now - request.arrived_s)
            queue_ms = (request.dispatched_s - request.arrived_s) * 1000.0
            out = to_clients.get(request.client) or self.outbox.client(request.client)
            out.replies.append(Reply(request.req_id, status, message, field_name, size, queue_ms, compute_ms))
            out.counts.append(count)
            if count:
                out.frames += frames[start:offset]

    def _on_preprocessed(
        self, batch: InFlightBatch, msg: BatchResult, frames: list[Any], rows: list[_Row | None]
    ) -> None:
        """A stage's result: answer the items it failed, queue the prepared batch of the rest for engines.
        Every OK item stays in the prepared batch, even one answered meanwhile (cancel, deadline): the payload
        holds its rows, so the engine must get as many ids as rows; its result is dropped."""
        ready: list[int] = []
        for item_id, row in zip(batch.item_ids, rows, strict=True):
            request = self.requests.get(item_id)
            if row is not None and row[0] == Status.OK:
                ready.append(item_id)
                if request is not None:
                    request.batch_id = 0  # waiting for an engine
            elif request is not None:
                status, message, field_name = row[:3] if row is not None else (Status.INTERNAL, "", "")
                message = message or f"preprocess stage {msg.worker} returned no result for this item"
                self.outbox.reply(request, status, message, field=field_name, batch_size=len(batch.item_ids))
        if ready and msg.prepared_frames:
            self.scheduler.add_prepared(batch.model, ready, frames[len(frames) - msg.prepared_frames :])

    def on_step(self, msg: StepOutput, frames: list[Any], now: float) -> None:
        """A generative engine's step: stream each sequence's new text, answer the finished ones."""
        worker_id = msg.worker.encode()
        worker = self.pool.workers.get(worker_id)
        if worker is not None and worker.models:
            self._add_busy(worker.models[0], ENGINE, msg.step_ms)
            self.pool.progressed(worker_id, now)
            stats = self.stats[worker.models[0]]
            stats.slowest_batch_s = max(stats.slowest_batch_s, msg.step_ms / 1000.0 / max(1, msg.steps))
            stats.engine_steps += msg.steps
            stats.batch_tokens += msg.batch_tokens
            worker.preemptions = msg.preemptions
            worker.prompt_tokens = msg.prompt_tokens
            worker.cached_prompt_tokens = msg.cached_prompt_tokens
        fields = msg.fields or [""] * len(msg.batch_ids)
        n = len(msg.batch_ids)
        rows, _ = _rows(n, len(frames), msg.statuses, msg.messages, fields, msg.frame_counts)
        complete = min(len(msg.texts), len(msg.num_tokens), len(msg.finished))
        for i, batch_id in enumerate(msg.batch_ids):
            batch = self.pool.batch(batch_id)
            if batch is None or batch.worker_id != worker_id:
                continue  # aborted here already (cancel, deadline), its engine was declared lost, or stale
            request = self.requests.get(batch.item_ids[0])
            row = rows[i]
            if row is None or i >= complete:
                log.error("step output from %s is missing fields for batch %d: it fails", msg.worker, batch_id)
                self.pool.finish(batch_id)
                self.outbox.to_worker(worker_id, Abort([batch_id]))
                if request is not None and request.batch_id == batch_id:
                    self.outbox.reply(request, Status.INTERNAL, f"engine {msg.worker} sent a malformed step output")
                continue
            finished = msg.finished[i]
            if finished:
                self.pool.finish(batch_id)
            if request is None or request.batch_id != batch_id:
                continue
            text = msg.texts[i]
            if text and request.stream:
                request.chunks_sent += 1
                logprobs = msg.logprobs[i] if i < len(msg.logprobs) else []
                self.outbox.chunk(request.client, Chunk(request.req_id, text, msg.num_tokens[i], logprobs))
            if finished:
                status, message, field_name, start, stop = row
                stats = self.stats[request.model]
                stats.latencies_s.append(now - request.arrived_s)
                stats.batch_done(1)
                self.outbox.reply(
                    request,
                    status,
                    message,
                    frames[start:stop],
                    field=field_name,
                    batch_size=1,
                    queue_ms=(request.dispatched_s - request.arrived_s) * 1000.0,
                )


def _accounts_for(n: int, n_frames: int, msg: BatchResult) -> bool:
    """Whether a worker's result has a status, message, field and frame count for each of ``n`` items, and
    exactly the frames those counts add up to."""
    counts = msg.frame_counts
    return (
        len(msg.statuses) == len(msg.messages) == len(msg.fields) == len(counts) == n
        and sum(counts) == n_frames
        and min(counts, default=0) >= 0
    )


_Row = tuple[Status, str, str, int, int]  # status, message, field, first frame, end frame


def _rows(
    n: int, n_frames: int, statuses: list[Status], messages: list[str], fields: list[str], counts: list[int]
) -> tuple[list[_Row | None], int]:
    """Per item of a worker's multi-item message: its status, message, field and frame range; None where
    the message does not account for the item (a list too short, frames missing). Also: how many are None."""
    rows: list[_Row | None] = []
    offset = 0
    for i in range(n):
        if i >= len(statuses) or i >= len(messages) or i >= len(fields) or i >= len(counts):
            break
        count = counts[i]
        if count < 0 or offset + count > n_frames:
            break
        rows.append((statuses[i], messages[i], fields[i], offset, offset + count))
        offset += count
    missing = n - len(rows)
    return rows + [None] * missing, missing

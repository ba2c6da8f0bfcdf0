"""The broker process: one thread, one poll loop, the batching scheduler.

Sockets (the broker binds, everyone else connects):
  client ROUTER  <- Submit / Cancel / HealthQuery from frontends and direct clients; -> Reply / HealthReport
  work   ROUTER  <- Hello from workers; -> Batch / Heartbeat / Reset / Shutdown, addressed by identity
  out    PULL    <- BatchResult and Heartbeat from every worker (fan-in); StepOutput from generative engines

Generative models (a handler with ``generative = True``) are batched inside their engines, at every step:
here each sequence is a batch of one, admitted to the least-loaded engine with a free running slot (its
credits are its ``max_running``). Text deltas of streamed requests go to the client as Chunks, then the
one Reply; a cancel or a passed deadline aborts the sequence in its engine at once.

``python -m zserve.broker.broker --config-json '{...}' --client ... --work ... --out ...``
"""

from __future__ import annotations

import argparse
import logging
import random
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from zserve.broker.requests import Request, RequestTable
from zserve.broker.scheduler import Admission, BatchPolicy, Dispatch, Scheduler
from zserve.broker.workers import ENGINE, PREPROCESS, InFlightBatch, WorkerPool
from zserve.config import Config, Endpoints
from zserve.logs import setup_logging
from zserve.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Batch,
    BatchResult,
    Cancel,
    Chunk,
    Codec,
    HealthQuery,
    HealthReport,
    Heartbeat,
    Hello,
    ModelHealth,
    Reply,
    Reset,
    Shutdown,
    Status,
    StepOutput,
    Submit,
)
from zserve.transport import die_with_parent, make_socket

log = logging.getLogger("zserve.broker")

_NOBLOCK = int(zmq.NOBLOCK)  # a plain int: combining zmq's Flag enums costs more than the send
_DRAIN_LIMIT = 512  # messages read from one socket per loop turn, so no socket starves the others


class Broker:
    def __init__(
        self,
        config: Config,
        endpoints: Endpoints,
        staged: frozenset[str] = frozenset(),
        generative: frozenset[str] = frozenset(),
    ) -> None:
        self.config = config
        self.epoch = random.getrandbits(48)
        b = config.broker
        self.interval_s = b.heartbeat_interval_ms / 1000.0
        self.pool = WorkerPool(liveness_s=self.interval_s * b.heartbeat_liveness)
        self.generative = generative
        self.scheduler = Scheduler(
            {
                # a generative request is one sequence, sent the moment an engine has a free slot
                m.name: BatchPolicy(1, 0.0, m.max_queue)
                if m.name in generative
                else BatchPolicy(m.max_batch_size, m.max_wait_ms, m.max_queue)
                for m in config.models
            },
            self.pool,
            staged,
            # a restarted broker must not reuse ids an old engine may still report on
            first_batch_id=random.getrandbits(40) << 8,
        )
        self.busy_s: dict[tuple[str, str], float] = {}  # (model, role) -> compute time reported by workers
        self.timeouts_s = {m.name: m.timeout_ms / 1000.0 for m in config.models}
        self.requests = RequestTable()
        self.codec = Codec()
        self.stopping = False
        self.draining_since: float | None = None
        self._last_heartbeat_s = 0.0

        self.ctx = zmq.Context()
        self.client = make_socket(self.ctx, zmq.ROUTER, endpoints.client, bind=True, mandatory=True)
        self.work = make_socket(self.ctx, zmq.ROUTER, endpoints.work, bind=True, mandatory=True)
        self.out = make_socket(self.ctx, zmq.PULL, endpoints.out, bind=True)
        self.poller = zmq.Poller()
        for sock in (self.client, self.work, self.out):
            self.poller.register(sock, zmq.POLLIN)

    # ---- sending ----

    def _send(self, sock: zmq.Socket, identity: bytes, frames: list[Any]) -> bool:
        try:
            sock.send_multipart([identity, *frames], _NOBLOCK, copy=False)
            return True
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer is gone; EAGAIN: it stopped reading
            log.info("cannot send to %r: %s", identity, exc.strerror)
            return False

    def _reply(
        self, request: Request, status: Status, message: str = "", frames: Sequence[Any] = (), **fields: Any
    ) -> None:
        """The request's one answer (``fields``: the rest of Reply), and its removal from the table."""
        self.requests.pop(request.item_id)
        reply = Reply(request.req_id, status, message, **fields)
        self._send(self.client, request.client, [self.codec.encode(reply), *frames])

    def _fail_batch(self, batch: InFlightBatch, why: str) -> None:
        """A batch was lost with its worker: re-dispatch each item once, then answer ENGINE_LOST."""
        for item_id in reversed(batch.item_ids):  # each goes back to the head: reversed keeps their order
            request = self.requests.get(item_id)
            if request is None:
                continue
            request.attempts += 1
            request.batch_id = 0
            if request.chunks_sent:  # part of its text is out: a second run would repeat it
                self._reply(request, Status.ENGINE_LOST, f"{why} while streaming; the text so far is all there is")
            elif request.attempts > self.config.broker.max_redispatch:
                self._reply(request, Status.ENGINE_LOST, f"{why}; gave up after {request.attempts} attempts")
            else:
                self.scheduler.requeue(request.model, item_id, request.arrived_s)

    # ---- receiving ----

    def on_client(self, frames: list[zmq.Frame], now: float) -> None:
        identity = frames[0].bytes
        msg = self.codec.decode(frames[1].buffer, f"client {identity!r}") if len(frames) > 1 else None
        if isinstance(msg, Submit):
            self.on_submit(identity, msg, frames[2:], now)
        elif isinstance(msg, Cancel):
            request = self.requests.find(identity, msg.req_id)
            if request is not None:
                self.scheduler.remove(request.model, request.item_id)
                # A batch in flight is still computed (its result is dropped); a sequence is aborted.
                self._abort_sequence(request)
                self._reply(request, Status.CANCELLED, "cancelled by the client")
        elif isinstance(msg, HealthQuery):
            self._send(self.client, identity, [self.codec.encode(self.health(msg.query_id))])
        elif msg is not None:
            log.warning("unexpected %s from client %r", type(msg).__name__, identity)

    def on_submit(self, identity: bytes, msg: Submit, payload: list[zmq.Frame], now: float) -> None:
        def refuse(status: Status, message: str) -> None:
            self._send(self.client, identity, [self.codec.encode(Reply(msg.req_id, status, message))])

        if self.draining_since is not None:
            return refuse(Status.SHUTTING_DOWN, "the server is shutting down")
        if msg.stream and msg.model not in self.generative and msg.model in self.timeouts_s:
            return refuse(Status.BAD_REQUEST, f"model {msg.model!r} is not generative: nothing to stream")
        timeout_s = msg.timeout_ms / 1000.0 if msg.timeout_ms > 0 else self.timeouts_s.get(msg.model, 0.0)
        request = self.requests.add(identity, msg.req_id, msg.model, payload, msg.decoded, now, now + timeout_s)
        request.stream = msg.stream
        admission = self.scheduler.submit(msg.model, request.item_id, now)
        if admission is Admission.UNKNOWN_MODEL:
            self.requests.pop(request.item_id)
            refuse(Status.UNKNOWN_MODEL, f"no model named {msg.model!r}; serving {sorted(self.timeouts_s)}")
        elif admission is Admission.OVERLOADED:
            self.requests.pop(request.item_id)
            depth = self.scheduler.depth(msg.model)
            refuse(Status.OVERLOADED, f"model {msg.model!r} has {depth} requests queued (max_queue); retry later")

    def on_work(self, frames: list[zmq.Frame], now: float) -> None:
        identity = frames[0].bytes
        msg = self.codec.decode(frames[1].buffer, f"worker {identity!r}") if len(frames) > 1 else None
        if not isinstance(msg, Hello):
            if msg is not None:
                log.warning("unexpected %s from worker %r", type(msg).__name__, identity)
            return
        if msg.protocol != PROTOCOL_VERSION:
            log.error("worker %s speaks protocol %d, not %d: ignored", msg.worker, msg.protocol, PROTOCOL_VERSION)
            return
        unknown = [m for m in msg.models if m not in self.timeouts_s]
        if unknown:
            log.error("worker %s serves unknown models %s: ignored", msg.worker, unknown)
            return
        orphans = self.pool.register(
            identity,
            name=msg.worker,
            pid=msg.pid,
            role=msg.role,
            models=msg.models,
            credits=msg.credits,
            now=now,
            kv_blocks=msg.kv_blocks,
        )
        for batch in orphans:
            self._fail_batch(batch, f"worker {msg.worker} restarted")
        log.info("worker %s ready: %s %s, %d credits", msg.worker, msg.role, ",".join(msg.models), msg.credits)
        self._send(self.work, identity, [self.codec.encode(Heartbeat("broker"))])  # the welcome

    def on_out(self, frames: list[zmq.Frame], now: float) -> None:
        msg = self.codec.decode(frames[0].buffer, "a worker (out socket)")
        if isinstance(msg, StepOutput):
            self.pool.seen(msg.worker.encode(), now, free_kv_blocks=msg.free_kv_blocks)
            self.on_step(msg, frames[1:])
        elif isinstance(msg, BatchResult):
            self.pool.seen(msg.worker.encode(), now)
            self.on_result(msg, frames[1:], now)
        elif isinstance(msg, Heartbeat):
            worker_id = msg.sender.encode()
            if not self.pool.seen(worker_id, now, busy=msg.busy, free_kv_blocks=msg.free_kv_blocks):
                self._send(self.work, worker_id, [self.codec.encode(Reset("unknown worker"))])
        elif msg is not None:
            log.warning("unexpected %s on the out socket", type(msg).__name__)

    def on_result(self, msg: BatchResult, frames: list[zmq.Frame], now: float) -> None:
        batch = self.pool.finish(msg.batch_id)
        if batch is None:
            log.info("dropped late result of batch %d from %s", msg.batch_id, msg.worker)
            return
        key = (batch.model, batch.role)
        self.busy_s[key] = self.busy_s.get(key, 0.0) + msg.compute_ms / 1000.0
        if batch.role == PREPROCESS:
            return self.on_preprocessed(batch, msg, frames)
        offset = 0
        size = len(batch.item_ids)
        for item_id, status, message, field, count in zip(
            batch.item_ids, msg.statuses, msg.messages, msg.fields, msg.frame_counts, strict=False
        ):
            item_frames = frames[offset : offset + count]
            offset += count
            request = self.requests.get(item_id)
            if request is None or request.batch_id != msg.batch_id:
                continue  # answered already (deadline, cancel)
            self._reply(
                request,
                status,  # already a Status: the decoder typed it
                message,
                field=field,
                batch_size=size,
                queue_ms=(request.dispatched_s - request.arrived_s) * 1000.0,
                compute_ms=msg.compute_ms,
                frames=item_frames,
            )

    def on_step(self, msg: StepOutput, frames: list[zmq.Frame]) -> None:
        """A generative engine's step: stream each sequence's new text, answer the finished ones."""
        worker_id = msg.worker.encode()
        worker = self.pool.workers.get(worker_id)
        if worker is not None and worker.models:
            key = (worker.models[0], ENGINE)
            self.busy_s[key] = self.busy_s.get(key, 0.0) + msg.step_ms / 1000.0
        offset = 0
        fields = msg.fields or [""] * len(msg.batch_ids)
        for batch_id, text, num_tokens, finished, status, message, field, count in zip(
            msg.batch_ids, msg.texts, msg.num_tokens, msg.finished, msg.statuses, msg.messages, fields,
            msg.frame_counts, strict=False,
        ):  # fmt: skip
            item_frames = frames[offset : offset + count]
            offset += count
            batch = self.pool.batch(batch_id)
            if batch is None or batch.worker_id != worker_id:
                continue  # aborted here already (cancel, deadline), its engine was declared lost, or stale
            if finished:
                self.pool.finish(batch_id)
            request = self.requests.get(batch.item_ids[0])
            if request is None or request.batch_id != batch_id:
                continue
            if text and request.stream:
                request.chunks_sent += 1
                chunk = self.codec.encode(Chunk(request.req_id, text, num_tokens))
                if not self._send(self.client, request.client, [chunk]):  # its client is gone: stop computing
                    self._abort_sequence(request)
                    self.requests.pop(request.item_id)
                    continue
            if finished:
                self._reply(
                    request,
                    status,
                    message,
                    field=field,
                    batch_size=1,
                    queue_ms=(request.dispatched_s - request.arrived_s) * 1000.0,
                    frames=item_frames,
                )

    def _abort_sequence(self, request: Request) -> None:
        """A generative request in an engine: tell the engine to drop it (its blocks are freed at once) and
        take its slot back."""
        if request.model not in self.generative or request.batch_id == 0:
            return
        batch = self.pool.finish(request.batch_id)
        if batch is not None:
            self._send(self.work, batch.worker_id, [self.codec.encode(Abort([request.batch_id]))])

    def on_preprocessed(self, batch: InFlightBatch, msg: BatchResult, frames: list[zmq.Frame]) -> None:
        """A stage's result: answer the items it failed, queue the prepared batch of the rest for engines.
        Every OK item stays in the prepared batch, even one answered meanwhile (cancel, deadline): the payload
        holds its rows, so the engine must get as many ids as rows; its result is dropped."""
        ready: list[int] = []
        for item_id, status, message, field in zip(
            batch.item_ids, msg.statuses, msg.messages, msg.fields, strict=False
        ):
            request = self.requests.get(item_id)
            if status == Status.OK:
                ready.append(item_id)
                if request is not None:
                    request.batch_id = 0  # waiting for an engine
            elif request is not None:
                self._reply(request, status, message, field=field, batch_size=len(batch.item_ids))
        if ready and msg.prepared_frames:
            self.scheduler.add_prepared(batch.model, ready, frames[len(frames) - msg.prepared_frames :])

    # ---- periodic work ----

    def dispatch(self, now: float) -> None:
        dispatches = self.scheduler.pop_batches(now)
        for n, d in enumerate(dispatches):
            if d.worker.worker_id not in self.pool.workers:  # its send failed earlier in this round
                self._requeue_undelivered(d)
                continue
            if d.prepared is not None:
                header, frames = self._prepared_batch(d)
            else:
                # Aligned with d.item_ids (results are matched by position). An item answered meanwhile
                # cannot be here, but if it were it would travel without payload and fail alone.
                requests = [self.requests.get(i) for i in d.item_ids]
                frames, counts = [], []
                for r in requests:
                    if r is not None:
                        r.batch_id = d.batch_id
                        r.dispatched_s = now
                        frames.extend(r.frames)
                    counts.append(len(r.frames) if r is not None else 0)
                decoded = [r.decoded if r is not None else True for r in requests]
                stream = [r is not None and r.stream for r in requests] if d.model in self.generative else []
                header = Batch(d.batch_id, d.model, d.item_ids, counts, decoded, stream=stream)
            if self._send(self.work, d.worker.worker_id, [self.codec.encode(header), *frames]):
                continue
            # Never delivered: forget the worker; batches of this round not yet sent go back untouched,
            # batches it received before are lost with it.
            log.warning("worker %s (pid %d) disconnected before batch %d", d.worker.name, d.worker.pid, d.batch_id)
            unsent = {x.batch_id for x in dispatches[n:]}
            for batch in self.pool.remove(d.worker.worker_id):
                if batch.batch_id not in unsent:
                    self._fail_batch(batch, f"worker {d.worker.name} disconnected")
            self._requeue_undelivered(d)

    def _requeue_undelivered(self, d: Dispatch) -> None:
        """Back to the head of the queue, in order, without counting an attempt (a prepared batch is
        preprocessed again)."""
        for item_id in reversed(d.item_ids):
            request = self.requests.get(item_id)
            if request is not None:
                request.batch_id = 0
                self.scheduler.requeue(d.model, item_id, request.arrived_s)

    def _prepared_batch(self, d: Dispatch) -> tuple[Batch, list[Any]]:
        decoded = []
        for item_id in d.item_ids:
            request = self.requests.get(item_id)
            if request is not None:  # answered meanwhile (deadline, cancel): computed, its result dropped
                request.batch_id = d.batch_id
            decoded.append(request.decoded if request is not None else True)
        frames = d.prepared.frames
        return Batch(d.batch_id, d.model, d.item_ids, [len(frames)], decoded, prepared=True), frames

    def housekeeping(self, now: float) -> None:
        for request in self.requests.expired(now):
            self.scheduler.remove(request.model, request.item_id)
            self._abort_sequence(request)
            waited = "in the queue" if request.batch_id == 0 else "in a worker"
            self._reply(
                request, Status.DEADLINE_EXCEEDED, f"deadline of {now - request.arrived_s:.3f}s passed {waited}"
            )
        for worker, batches in self.pool.expire(now):
            log.warning(
                "worker %s (pid %d) lost: no heartbeat for %.1fs", worker.name, worker.pid, self.pool.liveness_s
            )
            for batch in batches:
                self._fail_batch(batch, f"worker {worker.name} was lost")
        if now - self._last_heartbeat_s >= self.interval_s:
            self._last_heartbeat_s = now
            beat = self.codec.encode(Heartbeat("broker"))
            for worker_id, worker in list(self.pool.workers.items()):
                if not self._send(self.work, worker_id, [beat]):
                    batches = self.pool.remove(worker_id)
                    log.warning(
                        "worker %s (pid %d) disconnected, held %d batches", worker.name, worker.pid, len(batches)
                    )
                    for batch in batches:
                        self._fail_batch(batch, f"worker {worker.name} disconnected")

    def health(self, query_id: int) -> HealthReport:
        models = [
            ModelHealth(
                m.name,
                self.pool.ready_count(m.name),
                self.scheduler.depth(m.name),
                self.pool.in_flight_items(m.name),
                self.pool.busy_count(m.name),
                self.pool.ready_count(m.name, PREPROCESS),
                self.scheduler.prepared_depth(m.name),
                self.busy_s.get((m.name, ENGINE), 0.0),
                self.busy_s.get((m.name, PREPROCESS), 0.0),
                m.name in self.generative,
                self.pool.in_flight_items(m.name) if m.name in self.generative else 0,
                self.pool.free_kv_blocks(m.name),
            )
            for m in self.config.models
        ]
        return HealthReport(query_id, self.epoch, self.draining_since is not None, models)

    def _poll_timeout_ms(self, now: float) -> int:
        wake = self.interval_s
        batching = self.scheduler.next_wakeup_s(now)
        if batching is not None:
            wake = min(wake, batching)
        deadline = self.requests.next_deadline_s()
        if deadline is not None:
            wake = min(wake, max(0.0, deadline - now))
        return max(0, int(wake * 1000.0 + 0.999))  # round up: waking early only spins

    # ---- the loop ----

    def _drain(self, sock: zmq.Socket, handle: Any) -> None:
        for _ in range(_DRAIN_LIMIT):
            try:
                frames = sock.recv_multipart(_NOBLOCK, copy=False)
            except zmq.Again:
                return
            handle(frames, time.monotonic())

    def run(self) -> None:
        log.info("broker ready (epoch %x), models: %s", self.epoch, ", ".join(self.timeouts_s))
        while True:
            now = time.monotonic()
            if self.stopping and self.draining_since is None:
                self.draining_since = now
                log.info("draining: %d requests to finish, refusing new ones", len(self.requests))
            if self.draining_since is not None and (
                not self.requests or now - self.draining_since > self.config.broker.drain_timeout_s
            ):
                break
            events = dict(self.poller.poll(self._poll_timeout_ms(now)))
            if self.out in events:
                self._drain(self.out, self.on_out)
            if self.work in events:
                self._drain(self.work, self.on_work)
            if self.client in events:
                self._drain(self.client, self.on_client)
            now = time.monotonic()
            self.housekeeping(now)
            self.dispatch(now)
        self.shutdown()

    def shutdown(self) -> None:
        for request in self.requests.all():
            self._reply(request, Status.SHUTTING_DOWN, "the server shut down before this request finished")
        bye = self.codec.encode(Shutdown("broker stopping"))
        for worker_id in list(self.pool.workers):
            self._send(self.work, worker_id, [bye])
        for sock in (self.client, self.work, self.out):
            sock.close(linger=500)
        self.ctx.term()
        log.info("broker stopped")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zserve.broker.broker", description=__doc__)
    parser.add_argument("--config-json", required=True, help="the whole supervisor.toml, as JSON")
    parser.add_argument("--client", required=True, help="client endpoint to bind")
    parser.add_argument("--work", required=True, help="work endpoint to bind")
    parser.add_argument("--out", required=True, help="out (results) endpoint to bind")
    parser.add_argument("--staged-models", default="", help="comma-separated models with a preprocess stage")
    parser.add_argument("--generative-models", default="", help="comma-separated generative models")
    args = parser.parse_args(argv)
    setup_logging("broker")
    die_with_parent()
    config = msgspec.json.decode(args.config_json, type=Config)
    staged = frozenset(filter(None, args.staged_models.split(",")))
    generative = frozenset(filter(None, args.generative_models.split(",")))
    broker = Broker(config, Endpoints(args.client, args.work, args.out), staged, generative)

    def on_term(signum: int, _frame: Any) -> None:
        broker.stopping = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    broker.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The broker core: the whole request lifecycle, pure. No sockets and no clock of its own: every handler
takes ``now`` (seconds) and a decoded message, and what it has to send accumulates until ``flush()``
returns it, addressed: so the tests drive it with a fake clock, and the process shell (``broker.py``) only
polls, decodes, sends and handles signals.

Coalescing: everything for one client that arises between two flushes (all answers of a batch result, the
chunks of an engine step, refusals of a Submits) leaves as one ``Chunks`` and one ``Replies`` message, in
that order, so a streamed request's last text always arrives before its Reply.

Generative models (a handler with ``generative = True``) are batched inside their engines, at every step:
here each sequence is a batch of one, admitted to the least-loaded engine with a free running slot (its
credits are its ``max_running``). A cancel, a passed deadline or a client that is gone aborts the sequence
in its engine at once.

Jobs split out of this module, each an object built from the public collaborators it needs (the worker pool,
the request table, the scheduler, the per-model stats) rather than from the core: what is sent and every
request's one answer (``Outbox``, ``outbox.py``), workers' results (``Results``, ``results.py``, which also
says how their multi-item messages are length-checked), hung workers (``Hangs``, ``hangs.py``), tenants'
quotas and counts (``Tenants``, ``tenants.py``); and as functions: the Batch messages (``batches.py``), the
health report (``health.py``). The batching policy itself is ``zserve.batching``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from zserve.batching.routing import MAX_ROUTE_BLOCKS
from zserve.batching.scheduler import Admission, BatchPolicy, Scheduler
from zserve.batching.workers import InFlightBatch, WorkerPool
from zserve.broker.batches import batch_message, prepared_batch_message
from zserve.broker.hangs import Hangs
from zserve.broker.health import model_health, tenant_health
from zserve.broker.outbox import ClientSend, Outbox, WorkSend
from zserve.broker.requests import Request, RequestTable
from zserve.broker.results import Results
from zserve.broker.routes import Routes
from zserve.broker.stats import ModelStats
from zserve.broker.tenants import Tenants
from zserve.config import Config
from zserve.protocol import (
    PROTOCOL_VERSION,
    Abort,
    BatchResult,
    Cancel,
    HealthQuery,
    HealthReport,
    Heartbeat,
    Hello,
    InvalidItem,
    Leave,
    ModelHealth,
    Msg,
    Reply,
    Reset,
    Shutdown,
    Status,
    StepOutput,
    Submit,
    Submits,
)

log = logging.getLogger("zserve.broker")

# Items one Submits may carry: the broker handles a message in one go, so this bounds one message's share of a loop
# turn. zserve's clients send at most 1024 (``zserve.client.sync.MAX_ITEMS_PER_MESSAGE``).
MAX_SUBMITS_ITEMS = 4096


class BrokerCore:
    def __init__(
        self,
        config: Config,
        *,
        epoch: int,
        first_batch_id: int = 1,
        staged: frozenset[str] = frozenset(),
        generative: frozenset[str] = frozenset(),
    ) -> None:
        self.config = config
        self.epoch = epoch
        b = config.broker
        self.interval_s = b.heartbeat_interval_ms / 1000.0
        self.max_redispatch = b.max_redispatch
        self.pool = WorkerPool(liveness_s=self.interval_s * b.heartbeat_liveness)
        self.generative = generative
        self.scheduler = Scheduler(
            {
                # a generative request is one sequence, sent the moment an engine has a free slot
                m.name: BatchPolicy(1, 0.0, m.max_queue)
                if m.name in generative
                else BatchPolicy(m.max_batch_size, m.max_wait_ms, m.max_queue, m.max_batch_cost)
                for m in config.models
            },
            self.pool,
            staged,
            first_batch_id=first_batch_id,
            weights={t.name: t.weight for t in config.tenants},
            aging_s=b.priority_aging_ms / 1000.0,
        )
        self.timeouts_s = {m.name: m.timeout_ms / 1000.0 for m in config.models}
        self.stats = {m.name: ModelStats() for m in config.models}
        self.requests = RequestTable()
        self.outbox = Outbox(self.requests)
        self.tenants = Tenants(config.tenants, self.requests, self.outbox)
        self.results = Results(self.pool, self.requests, self.scheduler, self.stats, self.outbox)
        batch_timeouts_s = {m.name: m.batch_timeout_s for m in config.models}
        self.hangs = Hangs(batch_timeouts_s, self.timeouts_s, self.pool, self.requests, self.stats, self.outbox)
        # generative models routed cache_aware (``routing``): the engine whose prefix cache holds most of the prompt
        routed = [m.name for m in config.models if m.routes_by_cache(m.name in generative)]
        self.routes = Routes(routed, self.pool, self.requests)
        self.scheduler.routes = dict.fromkeys(routed, self.routes.choose)
        self.draining_since: float | None = None
        self.handing_over = False  # stopping to be replaced (a pod's SIGTERM): see start_draining
        self._last_heartbeat_s = float("-inf")

    # ---- output ----

    def flush(self) -> tuple[list[ClientSend], list[WorkSend]]:
        """Everything to send since the last flush (``Outbox.flush``)."""
        return self.outbox.flush()

    # ---- clients ----

    def on_client(self, identity: bytes, msg: Msg, frames: list[Any], now: float) -> None:
        if isinstance(msg, Submits):
            self.on_submits(identity, msg.items, msg.frame_counts, frames, now)
        elif isinstance(msg, Cancel):
            request = self.requests.find(identity, msg.req_id)
            if request is not None:
                self._drop(request)
                self.outbox.reply(request, Status.CANCELLED, "cancelled by the client")
        elif isinstance(msg, HealthQuery):
            self.outbox.to_client(identity, self.health(msg.query_id))
        else:
            log.warning("unexpected %s from client %r", type(msg).__name__, identity)

    def on_submits(
        self,
        identity: bytes,
        items: list[Submit | InvalidItem],
        frame_counts: list[int],
        frames: list[Any],
        now: float,
    ) -> None:
        if len(items) > MAX_SUBMITS_ITEMS:
            # Not from a zserve client (they split at 1024): answering each item would itself be the stall this
            # bound prevents, so the message is dropped whole and its items end at their client's deadline.
            log.warning("client %r sent a Submits of %d items (at most %d per message): dropped unanswered",
                        identity, len(items), MAX_SUBMITS_ITEMS)  # fmt: skip
            return
        if len(frame_counts) != len(items) or sum(frame_counts) != len(frames) or min(frame_counts, default=0) < 0:
            why = f"a Submits of {len(items)} items with {len(frame_counts)} frame counts and {len(frames)} frames"
            log.warning("client %r sent %s", identity, why)
            for item in items:
                if item.req_id is not None:
                    self.outbox.answer(identity, Reply(item.req_id, Status.BAD_REQUEST, f"malformed message: {why}"))
            return
        # The hot path of every request: locals, no helper calls unless something is wrong.
        timeouts_s = self.timeouts_s
        generative = self.generative
        add = self.requests.add
        submit = self.scheduler.submit
        stats = self.stats
        draining = self.draining_since is not None
        if self.handing_over:
            return  # unanswered: the client resubmits it to the broker that replaces this one
        offset = 0
        for item, count in zip(items, frame_counts, strict=True):
            payload = frames[offset : offset + count]
            offset += count
            model = item.model if type(item) is Submit else None
            if model is None:
                if item.req_id is not None:
                    self.outbox.answer(identity, Reply(item.req_id, Status.BAD_REQUEST, item.message))
                continue
            timeout_s = timeouts_s.get(model)
            if draining or timeout_s is None or not count or (item.stream and model not in generative):
                self._refuse(identity, item, count)
                continue
            if item.timeout_ms > 0:
                timeout_s = item.timeout_ms / 1000.0
            request = add(identity, item.req_id, model, payload, item.decoded, now, timeout_s, item.stream)
            if request is None:  # a client resubmitting what it believes lost: the first one answers
                log.info("client %r resubmitted request %d, which is pending: ignored", identity, item.req_id)
                continue
            if item.cost > 1:
                request.cost = item.cost
            if item.block_hashes_packed:  # a routed generative model's prompt blocks (the frontend bounds them too)
                request.block_hashes = item.block_hashes_packed[: 8 * MAX_ROUTE_BLOCKS]
            elif item.block_hashes:  # as frontends before block_hashes_packed send them
                request.block_hashes = item.block_hashes[:MAX_ROUTE_BLOCKS]
            if item.tenant or item.priority:  # the FIFO hot path pays this one test
                request.priority = item.priority
                if item.tenant and not self.tenants.admit(request, item.tenant, now):
                    continue
                admission = submit(model, request.item_id, now, request.cost, item.priority, item.tenant)
            else:
                admission = submit(model, request.item_id, now, request.cost)
            if (
                admission is Admission.OVERLOADED
                and not (stats[model].drain_s_per_item and self._lateness(request, stats[model], timeout_s))
                and self._make_room(request, item.tenant)
            ):  # room is made only for a request that would then be in time (the queue stays as full)
                admission = submit(model, request.item_id, now, request.cost, item.priority, item.tenant)
            if admission is Admission.OVERLOADED:
                self.tenants.count_overloaded(request)
                self.requests.pop(request.item_id)
                depth = self.scheduler.depth(model)
                message = f"model {model!r} has {depth} requests queued (max_queue); retry later"
                self.outbox.answer(identity, Reply(item.req_id, Status.OVERLOADED, message))
            elif stats[model].drain_s_per_item:
                self._refuse_if_late(request, stats[model], timeout_s)

    def _make_room(self, request: Request, tenant: str) -> bool:
        """The model's queue is full: if ``tenant`` holds less than its share of it, refuse (OVERLOADED, its one
        answer) the newest queued request of the tenant holding the most past its share, so that this one fits
        (``Scheduler.make_room``). False: nothing was taken out, and this request is the one refused."""
        pushed_id = self.scheduler.make_room(request.model, request.item_id, tenant)
        if pushed_id is None:
            return False
        pushed = self.requests.get(pushed_id)
        if pushed is not None:  # queued requests are always in the table; the check costs nothing
            self.tenants.count_overloaded(pushed)
            message = (
                f"model {request.model!r} has its max_queue of requests queued, and tenant {pushed.tenant!r} holds "
                f"more than its share of them: this, its newest, made room for tenant {tenant!r}; retry later"
            )
            self.outbox.reply(pushed, Status.OVERLOADED, message)
        return True

    def _refuse_if_late(self, request: Request, stats: ModelStats, timeout_s: float) -> None:
        """Deadline-aware admission: refuse (OVERLOADED, at once) a request that the queue ahead of it, at
        the measured compute time per item, would keep past its deadline: it would be computed for nobody.
        Generative models are not judged (a sequence's time depends on its output length). A request more urgent
        than the default (priority < 0) goes before the default-priority queue, so only what is in flight counts
        for it; the estimate does not model tenants' shares or the aging of less urgent requests."""
        model = request.model
        late = self._lateness(request, stats, timeout_s)
        if late is None:
            return
        wait_s, ahead = late
        self.scheduler.remove(model, request.item_id)
        self.tenants.count_overloaded(request)
        message = (
            f"model {model!r} would answer in about {wait_s * 1000.0:.0f} ms ({ahead} requests ahead, "
            f"{stats.item_s * 1000.0:.1f} ms of compute each): past this request's {timeout_s * 1000.0:.0f} ms "
            "deadline; retry later"
        )
        self.outbox.reply(request, Status.OVERLOADED, message)

    def _lateness(self, request: Request, stats: ModelStats, timeout_s: float) -> tuple[float, int] | None:
        """The wait the queue ahead of ``request`` would cost it and how many are ahead, if that is past its
        deadline; else None. The queue's depth counts ``request`` (queued, or a full queue it is to take a place
        in: the same depth once room is made)."""
        model = request.model
        depth = self.scheduler.depth(model)
        if 2.0 * depth * stats.drain_s_per_item <= timeout_s or model in self.generative:
            return None  # the usual case, without counting what is in flight (at most credits x a batch)
        ahead = (0 if request.priority < 0 else depth - 1) + self.pool.in_flight_items(model)
        wait_s = ahead * stats.drain_s_per_item + stats.item_s
        return (wait_s, ahead) if wait_s > timeout_s else None

    def _refuse(self, identity: bytes, item: Submit, count: int) -> None:
        if self.draining_since is not None:
            status, message = Status.SHUTTING_DOWN, "the server is shutting down"
        elif item.model not in self.timeouts_s:
            status, message = Status.UNKNOWN_MODEL, f"no model named {item.model!r}; serving {sorted(self.timeouts_s)}"
        elif not count:
            status, message = Status.BAD_REQUEST, "the request has no payload"
        else:
            status, message = Status.BAD_REQUEST, f"model {item.model!r} is not generative: nothing to stream"
        self.outbox.answer(identity, Reply(item.req_id, status, message))

    def client_unreachable(self, identity: bytes) -> None:
        """The shell could not send to this client (its socket is gone): stop working for it. Queued requests
        are dropped, sequences aborted; a batch in flight is still computed and its result dropped."""
        requests = self.requests.of_client(identity)
        if requests:
            log.info("client %r is gone: dropping its %d pending requests", identity, len(requests))
        for request in requests:
            self._drop(request)
            self.requests.pop(request.item_id)

    def _drop(self, request: Request) -> None:
        """Take a request out of the queue, or abort its sequence in its engine."""
        self.scheduler.remove(request.model, request.item_id)
        if request.model in self.generative and request.batch_id:
            batch = self.pool.finish(request.batch_id)  # the engine's slot is free again now
            if batch is not None:
                self.outbox.to_worker(batch.worker_id, Abort([request.batch_id]))

    # ---- workers: registration ----

    def on_work(self, identity: bytes, msg: Msg, now: float) -> None:
        if isinstance(msg, Leave):
            return self.on_leave(identity, msg, now)
        if not isinstance(msg, Hello):
            log.warning("unexpected %s from worker %r", type(msg).__name__, identity)
            return
        if msg.protocol != PROTOCOL_VERSION:
            log.error("worker %s speaks protocol %d, not %d: ignored", msg.worker, msg.protocol, PROTOCOL_VERSION)
            return
        if self.hangs.is_hung(identity):
            log.warning("worker %s was found hung: its Hello is ignored (it is being replaced)", msg.worker)
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
            preprocesses=msg.preprocesses,
            versions=msg.versions,
        )
        self._fail_batches(orphans, f"worker {msg.worker} restarted")
        if self.routes.routers:
            self.routes.on_hello(identity, msg)
        log.info("worker %s ready: %s %s, %d credits", msg.worker, msg.role, ",".join(msg.models), msg.credits)
        self.outbox.to_worker(identity, Heartbeat("broker"))  # the welcome

    def on_leave(self, identity: bytes, msg: Leave, now: float) -> None:
        """A worker is stopping (SIGTERM): no more work for it; what it hands back goes to the head of its queue
        with no attempt counted (nothing was lost); ``tick`` dismisses it (Shutdown) once it holds nothing."""
        worker = self.pool.workers.get(identity)
        if worker is None:  # unknown (the broker restarted, or it was expired): it holds nothing of ours
            self.outbox.to_worker(identity, Shutdown("leave: this broker holds nothing of yours"))
            return
        self.pool.seen(identity, now)
        handed_back = 0
        for batch_id in msg.batch_ids:
            batch = self.pool.batch(batch_id)
            if batch is None or batch.worker_id != identity:
                continue  # answered or expired meanwhile
            self.pool.finish(batch_id)
            self._requeue(batch.model, batch.item_ids)
            handed_back += 1
        if not worker.leaving:
            log.info("worker %s leaving: finishing %d batches, handed back %d", worker.name,
                     len(worker.in_flight), handed_back)  # fmt: skip
        elif handed_back:
            log.info("worker %s handed back %d more batches", worker.name, handed_back)
        worker.leaving = True

    def worker_unreachable(self, worker_id: bytes, undelivered: Iterable[int] = ()) -> None:
        """The shell could not send to this worker: forget it. ``undelivered`` batches (of this flush) never
        reached it and go back to their queues untouched; what it held before is re-dispatched or failed."""
        worker = self.pool.workers.get(worker_id)
        if worker is None:
            return
        undelivered = set(undelivered)
        batches = self.pool.remove(worker_id)
        log.warning("worker %s (pid %d) disconnected, held %d batches", worker.name, worker.pid, len(batches))
        for batch in batches:
            if batch.batch_id in undelivered:
                self._requeue(batch.model, batch.item_ids)
        self._fail_batches([b for b in batches if b.batch_id not in undelivered], f"worker {worker.name} disconnected")

    def _requeue(self, model: str, item_ids: list[int]) -> None:
        """Back to the head of the queue, in order, without counting an attempt (a prepared batch is
        preprocessed again)."""
        for item_id in reversed(item_ids):
            request = self.requests.get(item_id)
            if request is not None:
                request.batch_id = 0
                self.scheduler.requeue(model, item_id, request.arrived_s, request.cost, tenant=request.tenant)

    def _fail_batches(self, batches: list[InFlightBatch], why: str, alone: Iterable[int] = ()) -> None:
        """Batches lost with their worker: re-dispatch each item ``max_redispatch`` times, then answer
        ENGINE_LOST. Items in ``alone`` are re-dispatched in batches of one."""
        alone = set(alone)
        for batch in batches:
            for item_id in reversed(batch.item_ids):  # each goes back to the head: reversed keeps their order
                request = self.requests.get(item_id)
                if request is None:
                    continue
                request.attempts += 1
                request.batch_id = 0
                if request.chunks_sent:  # part of its text is out: a second run would repeat it
                    message = f"{why} while streaming; the text so far is all there is"
                    self.outbox.reply(request, Status.ENGINE_LOST, message)
                elif request.attempts > self.max_redispatch:
                    self.outbox.reply(request, Status.ENGINE_LOST, f"{why}; gave up after {request.attempts} attempts")
                else:
                    if item_id in alone:
                        request.suspect = True
                    self.scheduler.requeue(
                        request.model, item_id, request.arrived_s, request.cost, item_id in alone, request.tenant
                    )

    # ---- workers: results ----

    def on_out(self, msg: Msg, frames: list[Any], now: float) -> None:
        if isinstance(msg, StepOutput):
            self.pool.seen(msg.worker.encode(), now, free_kv_blocks=msg.free_kv_blocks)
            if msg.stored_blocks or msg.evicted_blocks:
                self.routes.on_step(msg.worker.encode(), msg)
            self.results.on_step(msg, frames, now)
        elif isinstance(msg, BatchResult):
            self.pool.seen(msg.worker.encode(), now)
            self.results.on_result(msg, frames, now)
        elif isinstance(msg, Heartbeat):
            worker_id = msg.sender.encode()
            known = self.pool.seen(worker_id, now, busy=msg.busy, free_kv_blocks=msg.free_kv_blocks)
            if not known and not self.hangs.is_hung(worker_id):
                self.outbox.to_worker(worker_id, Reset("unknown worker"))
        else:
            log.warning("unexpected %s on the out socket", type(msg).__name__)

    # ---- time ----

    def tick(self, now: float, heard_s: float | None = None) -> None:
        """Deadlines, worker liveness, heartbeats to workers, then dispatch of every batch that is ready.

        ``heard_s``: when the shell last found the out socket (heartbeats, results) empty, i.e. up to when it has
        heard everything the workers said (default ``now``). Silence and stalls are measured to then, not to
        ``now``: a broker that was busy (a burst of requests, a slow machine) finds its workers' heartbeats
        waiting in its socket, and takes its own lag for their silence no more."""
        heard = now if heard_s is None else min(heard_s, now)
        for request in self.requests.expired(now):
            self._drop(request)
            waited = "in the queue" if request.batch_id == 0 else "in a worker"
            self.outbox.reply(
                request, Status.DEADLINE_EXCEEDED, f"deadline of {now - request.arrived_s:.3f}s passed {waited}"
            )
        for worker, batches in self.pool.expire(heard):
            log.warning(
                "worker %s (pid %d) lost: no heartbeat for %.1fs", worker.name, worker.pid, self.pool.liveness_s
            )
            self._fail_batches(batches, f"worker {worker.name} was lost")
        for worker in self.pool.hung(heard, self.hangs.timeout_s, self.hangs.shortest_s):
            batches, alone = self.hangs.hang(worker, now)
            self._fail_batches(batches, f"worker {worker.name} hung", alone)
        for worker in self.pool.left():
            log.info("worker %s left (pid %d)", worker.name, worker.pid)
            self.outbox.to_worker(worker.worker_id, Shutdown("left: you hold nothing"))
        if now - self._last_heartbeat_s >= self.interval_s:
            self._last_heartbeat_s = now
            beat = Heartbeat("broker")
            for worker_id in self.pool.workers:
                self.outbox.to_worker(worker_id, beat)
        self.dispatch(now)

    def batch_timeout_s(self, model: str) -> float:
        """How long a worker of ``model`` may hold work without progress before it counts as hung."""
        return self.hangs.batch_timeout_s(model)

    def take_kills(self) -> list[tuple[int, str]]:
        """Hung workers to kill: (pid, the name it registered with)."""
        return self.hangs.take_kills()

    def dispatch(self, now: float) -> None:
        if self.handing_over:
            return
        for d in self.scheduler.pop_batches(now):
            if d.prepared is not None:
                header, frames = prepared_batch_message(d, self.requests)
            else:
                header, frames = batch_message(d, self.requests, self.generative, now)
            self.outbox.to_worker(d.worker.worker_id, header, frames, d.batch_id)

    def next_wakeup_s(self, now: float) -> float:
        """Seconds until ``tick`` has something to do without a new message: a batching window closing, a
        deadline, the next heartbeat."""
        wake = max(0.0, self._last_heartbeat_s + self.interval_s - now)
        batching = self.scheduler.next_wakeup_s(now)
        if batching is not None:
            wake = min(wake, batching)
        deadline = self.requests.next_deadline_s()
        if deadline is not None:
            wake = min(wake, max(0.0, deadline - now))
        return wake

    # ---- health and stopping ----

    def _model_health(self, name: str) -> ModelHealth:
        generative = name in self.generative
        health = model_health(name, self.pool, self.scheduler, self.stats[name], self.results.busy_s, generative)
        health.routing = self.routes.report(name)
        return health

    def health(self, query_id: int) -> HealthReport:
        return HealthReport(
            query_id,
            self.epoch,
            self.draining_since is not None and not self.handing_over,  # handing over refuses nothing
            [self._model_health(m.name) for m in self.config.models],
            tenant_health(self.tenants.counts, self.scheduler, self.requests.pending_by_tenant),
        )

    def start_draining(self, now: float, handover: bool = False) -> None:
        """Stop. ``handover=False`` (`zserve up` stopping): refuse new requests (SHUTTING_DOWN), finish the
        pending ones, then tell the workers to exit. ``handover=True`` (a broker pod replaced: the clients and
        workers stay): take nothing new and dispatch nothing more, finish only the batches workers hold, then go
        without a word: each client resubmits its unanswered requests to the next broker at this address, and
        the workers register with it."""
        if self.draining_since is None:
            self.draining_since = now
            self.handing_over = handover
            if handover:
                log.info("handing over: finishing the batches workers hold; %d requests are left to their clients "
                         "to resubmit to the next broker", len(self.requests))  # fmt: skip
            else:
                log.info("draining: %d requests to finish, refusing new ones", len(self.requests))

    def drained(self, now: float) -> bool:
        """Draining and done: nothing pending (handing over: nothing in a worker), or the drain timeout passed."""
        if self.draining_since is None:
            return False
        if now - self.draining_since > self.config.broker.drain_timeout_s:
            return True
        return not self.pool.in_flight_total() if self.handing_over else not self.requests

    def shut_down(self) -> None:
        """Answer whatever is still pending and tell every worker to exit (then ``flush``); handing over, do
        neither (see ``start_draining``)."""
        if self.handing_over:
            return
        for request in self.requests.all():
            self.outbox.reply(request, Status.SHUTTING_DOWN, "the server shut down before this request finished")
        for worker_id in self.pool.workers:
            self.outbox.to_worker(worker_id, Shutdown("broker stopping"))

"""The worker pool: who is registered, their credits, liveness and in-flight batches. Pure: no sockets,
no clock of its own (``now`` is passed in, in seconds)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from heapq import heapify, heappop, heappush, heapreplace

ENGINE = "engine"
PREPROCESS = "preprocess"


@dataclass(slots=True)
class InFlightBatch:
    batch_id: int
    model: str
    item_ids: list[int]
    worker_id: bytes
    sent_s: float
    role: str = ENGINE


@dataclass(slots=True)
class Worker:
    worker_id: bytes  # its DEALER identity, used to address batches to it
    name: str
    pid: int
    role: str
    models: tuple[str, ...]
    credits: int
    last_seen_s: float
    last_dispatch_s: float = 0.0
    busy: bool = False  # from its last heartbeat: inside predict right now
    progress_s: float = 0.0  # its last result or engine step, or when it got work while idle
    free_kv_blocks: int = 0  # generative engines: at the last report (the whole pool at Hello)
    kv_blocks: int = 0  # generative engines: the pool's size (Hello)
    preprocesses: bool = False  # an engine that takes a staged model's batches unpreprocessed when idle (Hello)
    versions: str = ""  # the libraries it runs on (Hello), for `zserve status`
    # generative engines' counters since they started, from their last StepOutput
    preemptions: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    # in_flight, free_kv_blocks and last_dispatch_s rank the worker in the pool's choice (``WorkerPool.best``):
    # only the pool changes them, so that its ranking follows
    in_flight: dict[int, InFlightBatch] = field(default_factory=dict)
    leaving: bool = False  # said Leave: gets no more work, and is not counted as ready (for good: a Hello is new)

    @property
    def free_credits(self) -> int:
        return 0 if self.leaving else self.credits - len(self.in_flight)


class WorkerPool:
    def __init__(self, liveness_s: float) -> None:
        self.liveness_s = liveness_s  # silence after which a worker is declared lost
        self.workers: dict[bytes, Worker] = {}
        self._batches: dict[int, InFlightBatch] = {}
        # told of every worker that leaves the pool (lost, restarted, left): the routers drop its cache entries
        self.on_removed: Callable[[bytes], None] | None = None
        self.on_finished: Callable[[InFlightBatch], None] | None = None  # and of every batch finished
        # ``best`` without a scan of every worker (a scan cost ~20 us a request with 64 engines): per (model, role),
        # a heap of rank entries [batches held, -free KV blocks, last dispatch, registration number (ties go to
        # the first registered, the pool's order), push number (never equal, so what follows is never compared),
        # worker, the heaps it is in]. A worker's entry is a lower bound of its rank: when its rank falls (a batch
        # finished, more free KV blocks) it is renewed at once: in place at the top of its one heap, else a new
        # entry replaces it (the old one is marked dead: worker None); when it rises (a batch started, fewer free
        # KV blocks) the entry is renewed only once it reaches the top. Dead entries, and live ones without credit
        # (pushed again when one of their batches finishes), are dropped when they reach the top.
        self._ranks: dict[tuple[str, str], list[list]] = {}
        self._entry: dict[bytes, list] = {}  # worker id -> its live entry, shared by its models' heaps
        self._registered = itertools.count()
        self._pushed = itertools.count()
        # at most every worker's last_seen_s: while ``now`` is within liveness of it, ``expire`` need not scan
        self._seen_floor_s = float("inf")
        # at most every busy worker's progress_s: while ``now`` is within the shortest hang timeout of it, ``hung``
        # need not scan (a scan cost ~25 us a loop turn with 64 busy engines)
        self._progress_floor_s = float("inf")

    def register(
        self,
        worker_id: bytes,
        *,
        name: str,
        pid: int,
        role: str,
        models: list[str],
        credits: int,
        now: float,
        kv_blocks: int = 0,
        preprocesses: bool = False,
        versions: str = "",
    ) -> list[InFlightBatch]:
        """Add (or re-add) a worker. A worker that says Hello again has lost whatever it held: those
        batches are returned for re-dispatch."""
        orphans = self.remove(worker_id)
        self.workers[worker_id] = Worker(
            worker_id, name, pid, role, tuple(models), credits, now, free_kv_blocks=kv_blocks, kv_blocks=kv_blocks,
            preprocesses=preprocesses, versions=versions,
        )  # fmt: skip
        worker = self.workers[worker_id]
        self._seen_floor_s = min(self._seen_floor_s, now)
        heaps = [self._ranks.setdefault((model, role), []) for model in dict.fromkeys(models)]
        entry = [0, -kv_blocks, 0.0, next(self._registered), next(self._pushed), worker, heaps]
        self._entry[worker_id] = entry
        for ranks in heaps:
            heappush(ranks, entry)
        return orphans

    def remove(self, worker_id: bytes) -> list[InFlightBatch]:
        worker = self.workers.pop(worker_id, None)
        if worker is None:
            return []
        self._unrank(worker_id)
        if self.on_removed is not None:
            self.on_removed(worker_id)
        for batch_id in worker.in_flight:
            self._batches.pop(batch_id, None)
        return list(worker.in_flight.values())

    def seen(self, worker_id: bytes, now: float, busy: bool | None = None, free_kv_blocks: int = -1) -> bool:
        """Note a sign of life; False if the worker is unknown (it must say Hello again)."""
        worker = self.workers.get(worker_id)
        if worker is None:
            return False
        worker.last_seen_s = now
        if now < self._seen_floor_s:  # a clock that went back (the broker's does not; tests' may)
            self._seen_floor_s = now
        if busy is not None:
            worker.busy = busy
        if free_kv_blocks >= 0 and free_kv_blocks != worker.free_kv_blocks:
            more = free_kv_blocks > worker.free_kv_blocks
            worker.free_kv_blocks = free_kv_blocks
            if more:
                self._rank(worker)
        return True

    def best(self, model: str, role: str = ENGINE) -> Worker | None:
        """The ``role`` worker to give the next batch of ``model``: has credit, holds the fewest batches
        (for a generative engine: sequences), then has the most free KV blocks, then was used least
        recently (spreads load over workers), then registered first."""
        ranks = self._ranks.get((model, role))
        while ranks:
            top = ranks[0]
            worker = top[5]
            if worker is None or worker.leaving or worker.credits <= len(worker.in_flight):  # no free credit
                heappop(ranks)
            elif top[0] == len(worker.in_flight) and top[1] == -worker.free_kv_blocks:
                return worker  # its entry is current (its last dispatch too: that moves only with a start)
            else:
                self._rank(worker)  # its rank rose since its entry was pushed
        return None

    def batch(self, batch_id: int) -> InFlightBatch | None:
        return self._batches.get(batch_id)

    def start(self, worker: Worker, batch_id: int, model: str, item_ids: list[int], now: float) -> InFlightBatch:
        if worker.free_credits <= 0:
            raise RuntimeError(f"worker {worker.name} has no credit")
        batch = InFlightBatch(batch_id, model, item_ids, worker.worker_id, now, worker.role)
        if not worker.in_flight:
            worker.progress_s = now  # idle until now: the hang clock starts with this batch
            if now < self._progress_floor_s:
                self._progress_floor_s = now
        worker.in_flight[batch_id] = batch
        worker.last_dispatch_s = now
        self._batches[batch_id] = batch  # its rank rose: ``best`` renews its entry if it reaches the top
        return batch

    def finish(self, batch_id: int) -> InFlightBatch | None:
        """The batch's result arrived: return its credit. None for an unknown (late, duplicate) batch."""
        batch = self._batches.pop(batch_id, None)
        if batch is not None:
            worker = self.workers.get(batch.worker_id)
            if worker is not None and worker.in_flight.pop(batch_id, None) is not None:
                self._rank(worker)
            if self.on_finished is not None:
                self.on_finished(batch)
        return batch

    def progressed(self, worker_id: bytes, now: float) -> None:
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.progress_s = now
            if now < self._progress_floor_s:  # a clock that went back (tests' may)
                self._progress_floor_s = now

    def hung(self, now: float, timeout_s: Callable[[Worker, float], float], shortest_s: float) -> list[Worker]:
        """Workers that hold work but made no progress for longer than ``timeout_s(worker, stalled_s)``, which
        is never below ``shortest_s``: the scan is skipped while no busy worker can have stalled that long."""
        if now - self._progress_floor_s <= shortest_s:
            return []
        busy = [w for w in self.workers.values() if w.in_flight]
        self._progress_floor_s = min((w.progress_s for w in busy), default=float("inf"))
        return [w for w in busy if (stalled_s := now - w.progress_s) > timeout_s(w, stalled_s)]

    def expire(self, now: float) -> list[tuple[Worker, list[InFlightBatch]]]:
        """Remove workers silent for longer than ``liveness_s``; return them with the batches they held."""
        if now - self._seen_floor_s <= self.liveness_s:  # no one silent for longer: the scan runs once a liveness
            return []
        lost = [w for w in self.workers.values() if now - w.last_seen_s > self.liveness_s]
        removed = [(w, self.remove(w.worker_id)) for w in lost]
        self._seen_floor_s = min((w.last_seen_s for w in self.workers.values()), default=float("inf"))
        return removed

    def _serving(self, model: str, role: str) -> Iterator[Worker]:
        return (w for w in self.workers.values() if w.role == role and model in w.models and not w.leaving)

    def left(self) -> list[Worker]:
        """Leaving workers that hold nothing any more: removed from the pool, for the broker to dismiss."""
        done = [w for w in self.workers.values() if w.leaving and not w.in_flight]
        for w in done:
            del self.workers[w.worker_id]
            self._unrank(w.worker_id)
            if self.on_removed is not None:
                self.on_removed(w.worker_id)
        return done

    def ready_count(self, model: str, role: str = ENGINE) -> int:
        return sum(1 for _ in self._serving(model, role))

    def free_credit_total(self, model: str, role: str = ENGINE) -> int:
        return sum(w.free_credits for w in self._serving(model, role))

    def idle_count(self, model: str, role: str = ENGINE) -> int:
        """Workers with credit and nothing in flight: the ones that wait for their next batch right now."""
        return sum(1 for w in self._serving(model, role) if not w.in_flight and w.free_credits > 0)

    def in_flight_batches(self, model: str, role: str = ENGINE) -> int:
        return sum(1 for b in self._batches.values() if b.model == model and b.role == role)

    def credit_total(self, model: str, role: str = ENGINE) -> int:
        return sum(w.credits for w in self._serving(model, role))

    def in_flight_total(self) -> int:
        """Batches (and sequences) held by workers, over every model."""
        return len(self._batches)

    def in_flight_items(self, model: str) -> int:
        return sum(len(b.item_ids) for b in self._batches.values() if b.model == model)

    def engines(self, model: str) -> list[Worker]:
        return list(self._serving(model, ENGINE))

    def _rank(self, worker: Worker) -> None:
        """After a change of ``worker``'s rank: its entry renewed in its models' heaps."""
        old = self._entry[worker.worker_id]  # a worker of the pool: only those finish, report or are chosen
        heaps = old[6]
        if len(heaps) == 1 and heaps[0] and heaps[0][0] is old:
            # at the top of its one heap (the worker chosen last): renewed in place, no entry to drop later
            old[0], old[1], old[2] = len(worker.in_flight), -worker.free_kv_blocks, worker.last_dispatch_s
            heapreplace(heaps[0], old)
            return
        old[5] = None
        entry = [len(worker.in_flight), -worker.free_kv_blocks, worker.last_dispatch_s, old[3], next(self._pushed),
                 worker, heaps]  # fmt: skip
        self._entry[worker.worker_id] = entry
        for ranks in heaps:
            if len(ranks) > _COMPACT_AT and len(ranks) > 4 * len(self.workers):
                ranks[:] = [e for e in ranks if e[5] is not None]  # the dead that never reached the top
                heapify(ranks)
            heappush(ranks, entry)

    def _unrank(self, worker_id: bytes) -> None:
        entry = self._entry.pop(worker_id, None)
        if entry is not None:
            entry[5] = None


_COMPACT_AT = 64  # a heap's entries before its dead ones are weeded out (at most 4 per worker then)

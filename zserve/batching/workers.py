"""The worker pool: who is registered, their credits, liveness and in-flight batches. Pure: no sockets,
no clock of its own (``now`` is passed in, in seconds)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

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
    in_flight: dict[int, InFlightBatch] = field(default_factory=dict)
    leaving: bool = False  # said Leave: gets no more work, and is not counted as ready

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
        return orphans

    def remove(self, worker_id: bytes) -> list[InFlightBatch]:
        worker = self.workers.pop(worker_id, None)
        if worker is None:
            return []
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
        if busy is not None:
            worker.busy = busy
        if free_kv_blocks >= 0:
            worker.free_kv_blocks = free_kv_blocks
        return True

    def best(self, model: str, role: str = ENGINE) -> Worker | None:
        """The ``role`` worker to give the next batch of ``model``: has credit, holds the fewest batches
        (for a generative engine: sequences), then has the most free KV blocks, then was used least
        recently (spreads load over workers)."""
        chosen = None
        for worker in self.workers.values():
            if worker.role != role or model not in worker.models or worker.free_credits <= 0:
                continue
            if chosen is None or _load(worker) < _load(chosen):
                chosen = worker
        return chosen

    def batch(self, batch_id: int) -> InFlightBatch | None:
        return self._batches.get(batch_id)

    def start(self, worker: Worker, batch_id: int, model: str, item_ids: list[int], now: float) -> InFlightBatch:
        if worker.free_credits <= 0:
            raise RuntimeError(f"worker {worker.name} has no credit")
        batch = InFlightBatch(batch_id, model, item_ids, worker.worker_id, now, worker.role)
        if not worker.in_flight:
            worker.progress_s = now  # idle until now: the hang clock starts with this batch
        worker.in_flight[batch_id] = batch
        worker.last_dispatch_s = now
        self._batches[batch_id] = batch
        return batch

    def finish(self, batch_id: int) -> InFlightBatch | None:
        """The batch's result arrived: return its credit. None for an unknown (late, duplicate) batch."""
        batch = self._batches.pop(batch_id, None)
        if batch is not None:
            worker = self.workers.get(batch.worker_id)
            if worker is not None:
                worker.in_flight.pop(batch_id, None)
            if self.on_finished is not None:
                self.on_finished(batch)
        return batch

    def progressed(self, worker_id: bytes, now: float) -> None:
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.progress_s = now

    def hung(self, now: float, timeout_s: Callable[[Worker, float], float]) -> list[Worker]:
        """Workers that hold work but made no progress for longer than ``timeout_s(worker, stalled_s)``."""
        stalled = ((w, now - w.progress_s) for w in self.workers.values() if w.in_flight)
        return [w for w, stalled_s in stalled if stalled_s > timeout_s(w, stalled_s)]

    def expire(self, now: float) -> list[tuple[Worker, list[InFlightBatch]]]:
        """Remove workers silent for longer than ``liveness_s``; return them with the batches they held."""
        lost = [w for w in self.workers.values() if now - w.last_seen_s > self.liveness_s]
        return [(w, self.remove(w.worker_id)) for w in lost]

    def _serving(self, model: str, role: str) -> Iterator[Worker]:
        return (w for w in self.workers.values() if w.role == role and model in w.models and not w.leaving)

    def left(self) -> list[Worker]:
        """Leaving workers that hold nothing any more: removed from the pool, for the broker to dismiss."""
        done = [w for w in self.workers.values() if w.leaving and not w.in_flight]
        for w in done:
            del self.workers[w.worker_id]
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


def _load(worker: Worker) -> tuple[int, int, float]:
    return (len(worker.in_flight), -worker.free_kv_blocks, worker.last_dispatch_s)

"""Hung workers, for the broker core (a job split out of it, working through its public collaborators: the
worker pool, the request table, the per-model stats and the outbox).

A worker that holds work but makes no progress (no result, no engine step) for its model's
``batch_timeout_s`` is hung (a ``predict`` that never returns, while its heartbeat thread lives on): it is
dropped, its batches are re-dispatched as for a lost worker, its Hellos are ignored from then on, it is told
to exit (``Replace``: its IO thread lives on) and the shell is asked to kill it as well (``take_kills``, for
a worker whose IO thread is stuck too), so that its supervisor starts a fresh one. The items of the batch
it was computing go again one per batch, as suspects: a worker that stalls on a suspect is hung after a few
batch times (``SUSPECT_BATCHES``, at least ``SUSPECT_FLOOR_S``), so a request that hangs every engine is
answered ENGINE_LOST after about ``batch_timeout_s`` plus that, and its batch-mates are answered as usual.
"""

from __future__ import annotations

import logging

from zserve.batching.workers import InFlightBatch, Worker, WorkerPool
from zserve.broker.outbox import Outbox
from zserve.broker.requests import RequestTable
from zserve.broker.stats import ModelStats
from zserve.protocol import Replace

# A worker computing a suspect (an item of a batch that hung, re-dispatched alone) is hung after this many of
# its model's slowest batch times without progress, but never sooner than the floor.
SUSPECT_BATCHES = 4
SUSPECT_FLOOR_S = 0.5

log = logging.getLogger("zserve.broker")


# Ids of workers found hung are remembered (their Hellos ignored) up to this many, the oldest forgotten first.
MAX_HUNG_REMEMBERED = 1024


class Hangs:
    """Finds how long a worker may stall (``timeout_s``, for ``WorkerPool.hung``), replaces a hung one
    (``hang``), remembers it (``is_hung``) and keeps the kills for the shell (``take_kills``)."""

    def __init__(
        self,
        batch_timeouts_s: dict[str, float | None],
        timeouts_s: dict[str, float],
        pool: WorkerPool,
        requests: RequestTable,
        stats: dict[str, ModelStats],
        outbox: Outbox,
    ) -> None:
        self.batch_timeouts_s = batch_timeouts_s  # model -> configured batch_timeout_s; None: derived
        self.timeouts_s = timeouts_s
        self.pool = pool
        self.requests = requests
        self.stats = stats
        self.outbox = outbox
        self._hung: dict[bytes, None] = {}  # ids of workers found hung (insertion-ordered, bounded)
        self._kills: list[tuple[int, str]] = []  # (pid, worker name) for the shell to kill
        # at most every worker's ``timeout_s`` (a derived batch timeout only grows from the model's timeout): no
        # worker stalled for less is hung, so ``WorkerPool.hung`` need not look
        self.shortest_s = min(
            [SUSPECT_FLOOR_S, *(t if t is not None else timeouts_s[m] for m, t in batch_timeouts_s.items())]
        )

    def batch_timeout_s(self, model: str) -> float:
        """How long a worker of ``model`` may hold work without progress before it counts as hung."""
        configured = self.batch_timeouts_s[model]
        if configured is not None:
            return configured
        return max(self.timeouts_s[model], 10.0 * self.stats[model].slowest_batch_s)

    def timeout_s(self, worker: Worker, stalled_s: float) -> float:
        """A worker's hang timeout: its model's ``batch_timeout_s``, or a shorter one while the batch it is
        computing holds a suspect (an item of a batch that hung, sent alone): that batch is one item, so
        ``SUSPECT_BATCHES`` of the slowest batch seen (at least ``SUSPECT_FLOOR_S``, against false alarms on a
        noisy machine) is ample, and a poison request does not cost a second full ``batch_timeout_s``."""
        timeout = self.batch_timeout_s(worker.models[0])
        if stalled_s <= min(timeout, SUSPECT_FLOOR_S):
            return timeout  # the common case, decided without looking at the batch
        running = next(iter(worker.in_flight.values()))  # in dispatch order: the oldest is the one computing
        get = self.requests.by_id.get
        if any((r := get(i)) is not None and r.suspect for i in running.item_ids):
            slowest = self.stats[worker.models[0]].slowest_batch_s
            return min(timeout, max(SUSPECT_FLOOR_S, SUSPECT_BATCHES * slowest))
        return timeout

    def is_hung(self, worker_id: bytes) -> bool:
        """Whether this worker was found hung (recently: see ``MAX_HUNG_REMEMBERED``)."""
        return worker_id in self._hung

    def take_kills(self) -> list[tuple[int, str]]:
        """Hung workers to kill: (pid, the name it registered with)."""
        kills, self._kills = self._kills, []
        return kills

    def hang(self, worker: Worker, now: float) -> tuple[list[InFlightBatch], list[int]]:
        """Replace a hung worker: it is dropped from the pool, told to exit and queued to be killed. Returns
        the batches it held, for the core to re-dispatch as for a lost worker, and the items to re-dispatch
        alone (those of the batch that hung)."""
        model = worker.models[0]
        stuck_s = now - worker.progress_s
        log.error(
            "worker %s (pid %d) is hung: no progress for %.1fs (batch_timeout_s %.1f); re-dispatching its "
            "%d batches and replacing it", worker.name, worker.pid, stuck_s, self.batch_timeout_s(model),
            len(worker.in_flight),
        )  # fmt: skip
        self.stats[model].workers_hung += 1
        self._hung[worker.worker_id] = None
        if len(self._hung) > MAX_HUNG_REMEMBERED:
            del self._hung[next(iter(self._hung))]
        self._kills.append((worker.pid, worker.name))
        # A worker's IO thread outlives a hung predict: told to exit, it is restarted by its own supervisor,
        # on whatever host it runs (the shell's SIGKILL only reaches this host's processes).
        self.outbox.to_worker(worker.worker_id, Replace(f"no progress for {stuck_s:.1f}s"))
        batches = self.pool.remove(worker.worker_id)
        # The oldest batch is the one that hung (a worker computes its batches in order): its items go
        # again one per batch, so that an item that hangs takes none of its batch-mates with it.
        running = min(batches, key=lambda b: b.sent_s, default=None)
        return batches, running.item_ids if running else []

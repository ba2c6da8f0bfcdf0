"""Hung workers (a job split out of the broker core; these functions run on its state, as its methods would).

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
from typing import TYPE_CHECKING

from zserve.batching.workers import Worker
from zserve.protocol import Replace

if TYPE_CHECKING:
    from zserve.broker.core import BrokerCore

# A worker computing a suspect (an item of a batch that hung, re-dispatched alone) is hung after this many of
# its model's slowest batch times without progress, but never sooner than the floor.
SUSPECT_BATCHES = 4
SUSPECT_FLOOR_S = 0.5

log = logging.getLogger("zserve.broker")


def hang_timeout_s(core: BrokerCore, worker: Worker, stalled_s: float) -> float:
    """A worker's hang timeout: its model's ``batch_timeout_s``, or a shorter one while the batch it is
    computing holds a suspect (an item of a batch that hung, sent alone): that batch is one item, so
    ``SUSPECT_BATCHES`` of the slowest batch seen (at least ``SUSPECT_FLOOR_S``, against false alarms on a
    noisy machine) is ample, and a poison request does not cost a second full ``batch_timeout_s``."""
    timeout = core.batch_timeout_s(worker.models[0])
    if stalled_s <= min(timeout, SUSPECT_FLOOR_S):
        return timeout  # the common case, decided without looking at the batch
    running = next(iter(worker.in_flight.values()))  # in dispatch order: the oldest is the one computing
    get = core.requests.by_id.get
    if any((r := get(i)) is not None and r.suspect for i in running.item_ids):
        slowest = core.stats[worker.models[0]].slowest_batch_s
        return min(timeout, max(SUSPECT_FLOOR_S, SUSPECT_BATCHES * slowest))
    return timeout


def hang(core: BrokerCore, worker: Worker, now: float) -> None:
    model = worker.models[0]
    stuck_s = now - worker.progress_s
    log.error(
        "worker %s (pid %d) is hung: no progress for %.1fs (batch_timeout_s %.1f); re-dispatching its "
        "%d batches and replacing it", worker.name, worker.pid, stuck_s, core.batch_timeout_s(model),
        len(worker.in_flight),
    )  # fmt: skip
    core.stats[model].workers_hung += 1
    core._hung[worker.worker_id] = None
    if len(core._hung) > 1024:
        del core._hung[next(iter(core._hung))]
    core._kills.append((worker.pid, worker.name))
    # A worker's IO thread outlives a hung predict: told to exit, it is restarted by its own supervisor,
    # on whatever host it runs (the shell's SIGKILL only reaches this host's processes).
    core.outbox.to_worker(worker.worker_id, Replace(f"no progress for {stuck_s:.1f}s"))
    batches = core.pool.remove(worker.worker_id)
    # The oldest batch is the one that hung (a worker computes its batches in order): its items go
    # again one per batch, so that an item that hangs takes none of its batch-mates with it.
    running = min(batches, key=lambda b: b.sent_s, default=None)
    core._fail_batches(batches, f"worker {worker.name} hung", alone=running.item_ids if running else ())

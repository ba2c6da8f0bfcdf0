"""``WorkerPool.best`` keeps its ranking as work starts and finishes, and ``expire`` scans only when someone may be
silent for too long; they must do what a scan of every worker does, the tie-breaks included, over any sequence of
the pool's events."""

from __future__ import annotations

import random

from zserve.batching.workers import ENGINE, PREPROCESS, Worker, WorkerPool

MODELS = ("m", "n", "o")
ROLES = (ENGINE, PREPROCESS)


def scan(pool: WorkerPool, model: str, role: str) -> Worker | None:
    """The choice as a scan: the first worker (in the pool's order) of the least (batches held, -free KV blocks,
    last dispatch) among those of ``role`` serving ``model`` with credit."""
    chosen = None
    for w in pool.workers.values():
        if w.role != role or model not in w.models or w.free_credits <= 0:
            continue
        load = (len(w.in_flight), -w.free_kv_blocks, w.last_dispatch_s)
        if chosen is None or load < (len(chosen.in_flight), -chosen.free_kv_blocks, chosen.last_dispatch_s):
            chosen = w
    return chosen


def _hello(pool: WorkerPool, rng: random.Random, names: list[bytes], now: float) -> None:
    worker_id = rng.choice(names)  # some say Hello again: a restart, its batches orphaned
    models = rng.sample(MODELS, rng.randrange(1, len(MODELS) + 1))
    pool.register(worker_id, name=worker_id.decode(), pid=1, role=rng.choice(ROLES), models=models,
                  credits=rng.randrange(4), now=now, kv_blocks=rng.choice((0, 8, 16)))  # fmt: skip


def _event(pool: WorkerPool, rng: random.Random, names: list[bytes], now: float, batch_ids: list[int]) -> None:
    kind = rng.randrange(10)
    workers = list(pool.workers.values())
    if kind == 0 or not workers:
        _hello(pool, rng, names, now)
    elif kind <= 3:  # take a credit: mostly the best worker's, as the scheduler does, else any with credit
        model, role = rng.choice(MODELS), rng.choice(ROLES)
        worker = pool.best(model, role) if rng.random() < 0.7 else rng.choice(workers)
        if worker is not None and worker.free_credits > 0:
            batch_ids.append(batch_id := len(batch_ids))
            pool.start(worker, batch_id, model, [batch_id], now)
    elif kind <= 5:  # return a credit (a result), sometimes a late or duplicate one
        if batch_ids:
            pool.finish(rng.choice(batch_ids))
    elif kind <= 7:  # a load report: few values, so ties on free KV blocks are common; -1: none reported
        pool.seen(rng.choice(workers).worker_id, now, busy=rng.random() < 0.5, free_kv_blocks=rng.choice((-1, 0, 4, 8)))
    elif kind == 8:  # lost: disconnected, or silent past liveness
        if rng.random() < 0.5:
            pool.remove(rng.choice(workers).worker_id)
        else:  # whether it scans or not, it expires the workers a scan finds silent
            silent = [w for w in workers if now - w.last_seen_s > pool.liveness_s]
            assert [w for w, _ in pool.expire(now)] == silent
    else:  # leaving (as the broker core marks it), and the workers that left with nothing held dismissed
        rng.choice(workers).leaving = True
        pool.left()


def test_best_is_the_scans_choice_over_random_events() -> None:
    rng = random.Random(35)
    for _ in range(200):
        pool = WorkerPool(liveness_s=rng.choice((0.5, 100.0)))
        names = [f"w{i}".encode() for i in range(rng.randrange(1, 9))]
        batch_ids: list[int] = []
        for step in range(300):
            now = rng.choice((0.0, 0.5)) + step // 10 * 0.25  # repeated times: ties on the last dispatch (and back)
            if rng.random() < 0.3:
                for w in pool.workers.values():
                    if rng.random() < 0.5:
                        pool.seen(w.worker_id, now)
            _event(pool, rng, names, now, batch_ids)
            for model in (*MODELS, "unknown"):
                for role in ROLES:
                    assert pool.best(model, role) is scan(pool, model, role), (model, role, step)
            assert pool._entry.keys() == pool.workers.keys()  # the ranking forgets the workers gone


def test_ties_go_to_the_first_registered_and_a_new_hello_goes_last() -> None:
    pool = WorkerPool(liveness_s=1.0)
    for name in (b"a", b"b", b"c"):
        pool.register(name, name=name.decode(), pid=1, role=ENGINE, models=["m"], credits=2, now=0.0)
    assert pool.best("m").worker_id == b"a"
    pool.register(b"a", name="a", pid=2, role=ENGINE, models=["m"], credits=2, now=0.0)  # restarted
    assert pool.best("m").worker_id == b"b"
    pool.seen(b"c", 0.0, free_kv_blocks=5)  # the most free KV blocks wins among equally loaded
    assert pool.best("m").worker_id == b"c"


def test_the_ranking_stays_bounded_under_many_load_reports() -> None:
    pool = WorkerPool(liveness_s=1.0)
    for name in (b"a", b"b"):
        pool.register(name, name=name.decode(), pid=1, role=ENGINE, models=["m"], credits=2, now=0.0)
    for i in range(10_000):
        pool.seen(b"a", 0.0, free_kv_blocks=i)
        pool.seen(b"b", 0.0, free_kv_blocks=i + 1)
    assert pool.best("m").worker_id == b"b"
    assert len(pool._ranks[("m", ENGINE)]) <= 80  # dead entries weeded out, not kept for every report

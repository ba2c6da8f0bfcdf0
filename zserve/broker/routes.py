"""The broker's cache-aware routing of generative models (``zserve.batching.routing``), wired to its pool and
requests: the index kept from engines' Hellos (snapshots) and StepOutputs (deltas), dropped when an engine
leaves the pool, and the choice of engine for a queued sequence. Pure, as the core is.

Only models with ``routing = "cache_aware"`` get a router; every other model, and a routed model whose request
carries no block hashes or that has one engine with credit, takes ``WorkerPool.best``'s choice unchanged.
"""

from __future__ import annotations

from zserve.batching.routing import LEAST_LOADED, MATCH, SPILL, PrefixRouter
from zserve.batching.workers import InFlightBatch, Worker, WorkerPool
from zserve.broker.requests import RequestTable
from zserve.protocol import EngineRouting, Hello, StepOutput


class Routes:
    def __init__(self, models: list[str], pool: WorkerPool, requests: RequestTable) -> None:
        self.routers = {m: PrefixRouter() for m in models}
        self.pool = pool
        self.requests = requests
        pool.on_removed = self.drop
        pool.on_finished = self.finished

    def drop(self, worker_id: bytes) -> None:
        for router in self.routers.values():
            router.drop(worker_id)

    def finished(self, batch: InFlightBatch) -> None:
        router = self.routers.get(batch.model)
        if router is not None:
            router.finish(batch.item_ids)

    def on_hello(self, worker_id: bytes, msg: Hello) -> None:
        """After the pool registered the engine: its snapshot replaces what was known of it."""
        for model in msg.models:
            router = self.routers.get(model)
            if router is not None:
                router.reset(worker_id, msg.block_hashes, msg.kv_blocks, msg.worker)

    def on_step(self, worker_id: bytes, msg: StepOutput) -> None:
        # each router's index knows the engines that said Hello for its model and are still in the pool, and
        # ignores the others' deltas (not registered yet, or any more: their Hello's snapshot will say it all)
        for router in self.routers.values():
            router.index.update(worker_id, msg.stored_blocks, msg.evicted_blocks)

    def choose(self, model: str, item_id: int, fallback: Worker) -> Worker:
        """The engine for queued sequence ``item_id`` (``fallback``: the pool's least-loaded engine with credit)."""
        router = self.routers[model]
        request = self.requests.by_id.get(item_id)
        hashes = request.block_hashes if request is not None else []
        engine = router.dispatch(item_id, hashes, fallback, self.pool.workers)[0]
        return fallback if engine is fallback.worker_id else self.pool.workers[engine]

    def report(self, model: str) -> list[EngineRouting]:
        router = self.routers.get(model)
        if router is None:
            return []
        return [
            EngineRouting(name, c.requested, c.found, c.decisions[MATCH], c.decisions[SPILL], c.decisions[LEAST_LOADED])
            for name, c in sorted(router.report().items())
        ]

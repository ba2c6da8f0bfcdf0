"""``zserve.Streamer``: dynamic batching inside one Python program, no server.

Many caller threads (or coroutines) call ``streamer.predict(items)``; their items are batched together
and run through the batch function by ``workers`` worker threads, or by ``processes`` spawned worker
processes. The batching policy is the pure ``Scheduler`` the broker runs too (``zserve.batching``; same
triggers: full by count, ``max_wait_ms``, an idle worker takes a lone request at once), driven here with a
real clock by the worker threads themselves.

Items and results cross to worker processes through multiprocessing pipes (pickled): a Streamer runs
the caller's own code on the caller's own objects, unlike the wire protocol between zserve processes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import multiprocessing
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from zserve.batching.scheduler import Admission, BatchPolicy, Dispatch, Scheduler
from zserve.batching.workers import ENGINE, WorkerPool
from zserve.errors import EngineLost, Overloaded
from zserve.model import Model, predict_inline, setup_inline

BatchFn = Callable[[list[Any]], Sequence[Any]]
_MODEL = "streamer"


class OutputCountError(ValueError):
    """The batch function returned a different number of outputs than it was given items."""


def _run(fn: BatchFn, items: list[Any]) -> list[Any]:
    outputs = fn(items)
    if not isinstance(outputs, list | tuple) or len(outputs) != len(items):
        count = len(outputs) if isinstance(outputs, list | tuple) else type(outputs).__name__
        raise OutputCountError(f"the batch function returned {count} outputs for {len(items)} items")
    return list(outputs)


def _as_batch_fn(predict: BatchFn | Model) -> BatchFn:
    if isinstance(predict, Model):
        return lambda items: predict_inline(predict, items)
    return predict


def _process_main(conn: Any, predict: BatchFn | Model, device: str | None) -> None:
    """A worker process: set up the model once, then answer batches until the pipe closes."""
    if device is not None and device.startswith("cuda:"):
        os.environ["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]  # before the model imports torch
        device = "cuda:0"
    if isinstance(predict, Model):
        setup_inline(predict, device or "cpu")
    fn = _as_batch_fn(predict)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            items = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", _run(fn, items)))
        except Exception as exc:
            try:
                conn.send(("error", exc))
            except Exception:  # the exception itself does not pickle
                conn.send(("error", RuntimeError(f"{type(exc).__name__}: {exc}")))


class _WorkerProcess:
    """Runs batches in one spawned process; used from one worker thread only."""

    def __init__(self, predict: BatchFn | Model, device: str | None) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_process_main, args=(child, predict, device), daemon=True)
        self.process.start()
        child.close()
        kind, self.pid = self._recv()
        assert kind == "ready"

    def _recv(self) -> Any:
        try:
            return self.conn.recv()
        except EOFError:
            raise EngineLost(f"streamer worker process {self.process.pid} died") from None

    def __call__(self, items: list[Any]) -> list[Any]:
        self.conn.send(items)
        kind, value = self._recv()
        if kind == "error":
            raise value
        return value

    def close(self) -> None:
        self.conn.close()
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


class Streamer:
    """Batch many callers' items together for one batch function (or a ``zserve.Model``).

    ``predict(items) -> list`` blocks; ``submit(items) -> Future``; ``await apredict(items)``. An exception
    raised by the batch function reaches exactly the callers whose items were in that batch, as the
    original exception. With ``processes=N`` the model is set up once in each of N spawned processes
    (``devices[i]`` each, via CUDA_VISIBLE_DEVICES for ``cuda:N``) and never in this one.

    ``max_batch_cost`` with ``cost`` (item -> int, e.g. its tokens; a ``Model``'s own ``cost`` if not
    given) batches by cost exactly as the broker does (see ``zserve.batching.scheduler``).
    """

    def __init__(
        self,
        predict: BatchFn | Model,
        *,
        max_batch_size: int = 32,
        max_wait_ms: float = 5.0,
        workers: int = 1,
        processes: int = 0,
        devices: Sequence[str] | None = None,
        max_queue: int = 100_000,
        max_batch_cost: int = 0,
        cost: Callable[[Any], int] | None = None,
    ) -> None:
        if max_batch_size < 1 or workers < 1 or processes < 0 or max_wait_ms < 0 or max_batch_cost < 0:
            raise ValueError("max_batch_size and workers must be >= 1, processes, max_wait_ms and max_batch_cost >= 0")
        if cost is None and max_batch_cost and isinstance(predict, Model):
            cost = predict.cost
        if max_batch_cost and cost is None:
            raise ValueError("max_batch_cost needs cost=, a function of an item that returns its cost")
        self._cost = cost if max_batch_cost else None
        self._pool = WorkerPool(liveness_s=float("inf"))
        policy = BatchPolicy(max_batch_size, max_wait_ms, max_queue, max_batch_cost)
        self._scheduler = Scheduler({_MODEL: policy}, self._pool)
        self._lock = threading.Condition()
        self._futures: dict[int, tuple[concurrent.futures.Future, Any]] = {}  # item id -> (future, item)
        self._ids = itertools.count()
        self._closed = False
        if processes:
            devices = list(devices or [])
            batch_fns: list[Callable[[list[Any]], list[Any]]] = [
                _WorkerProcess(predict, devices[i % len(devices)] if devices else None) for i in range(processes)
            ]
        else:
            if isinstance(predict, Model):
                setup_inline(predict, (devices or ["cpu"])[0])
            fn = _as_batch_fn(predict)
            batch_fns = [lambda items, fn=fn: _run(fn, items)] * workers
        self._batch_fns = batch_fns
        # Worker threads schedule for themselves (no scheduler thread: one hand-off less per request). The
        # scheduler addresses each batch to a worker; a batch found for another worker waits in its inbox.
        self._inboxes: list[deque[Dispatch]] = []
        self._threads: list[threading.Thread] = []
        for i, batch_fn in enumerate(batch_fns):
            self._pool.register(f"w{i}".encode(), name=f"w{i}", pid=0, role=ENGINE, models=[_MODEL], credits=1, now=0.0)
            self._inboxes.append(deque())
            thread = threading.Thread(target=self._work, args=(i, batch_fn), name=f"streamer-worker-{i}", daemon=True)
            self._threads.append(thread)
            thread.start()

    # ---- public API ----

    def submit(self, items: Sequence[Any]) -> concurrent.futures.Future:
        """One Future for the list of outputs of ``items`` (batched with other callers' items)."""
        items = list(items)
        result: concurrent.futures.Future = concurrent.futures.Future()
        if not items:
            result.set_result([])
            return result
        # Before the lock and before any item is queued: a cost function that raises fails the call alone.
        costs = [self._cost(item) for item in items] if self._cost else [1] * len(items)
        parts: list[concurrent.futures.Future] = []
        with self._lock:
            if self._closed:
                raise RuntimeError("the streamer is closed")
            max_queue = self._scheduler.policies[_MODEL].max_queue
            if self._scheduler.depth(_MODEL) + len(items) > max_queue:  # all or nothing
                raise Overloaded(f"{len(items)} more items would pass max_queue ({max_queue})")
            now = time.monotonic()
            for item, cost in zip(items, costs, strict=True):
                item_id = next(self._ids)
                admitted = self._scheduler.submit(_MODEL, item_id, now, cost)
                assert admitted is Admission.ACCEPTED
                part: concurrent.futures.Future = concurrent.futures.Future()
                self._futures[item_id] = (part, item)
                parts.append(part)
            self._lock.notify_all()
        _gather(parts, result)
        return result

    def predict(self, items: Sequence[Any]) -> list[Any]:
        return self.submit(items).result()

    async def apredict(self, items: Sequence[Any]) -> list[Any]:
        return await asyncio.wrap_future(self.submit(items))

    def close(self) -> None:
        """Finish the queued work, then stop the threads (and worker processes)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.notify_all()
        for thread in self._threads:
            thread.join()
        for batch_fn in self._batch_fns:
            if isinstance(batch_fn, _WorkerProcess):
                batch_fn.close()

    def __enter__(self) -> Streamer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def worker_pids(self) -> list[int]:
        return [r.pid for r in self._batch_fns if isinstance(r, _WorkerProcess)]

    # ---- threads ----

    def _next(self, index: int) -> Dispatch | None:
        """Wait (holding the lock) for this worker's next batch; None once closed and drained."""
        inbox = self._inboxes[index]
        while True:
            if not inbox:
                now = time.monotonic()
                for dispatch in self._scheduler.pop_batches(now):
                    self._inboxes[int(dispatch.worker.name[1:])].append(dispatch)
                if len(self._inboxes) > 1:
                    self._lock.notify_all()  # batches for other workers
            if inbox:
                return inbox.popleft()
            if self._closed and not self._futures:
                return None
            wait = self._scheduler.next_wakeup_s(time.monotonic())
            self._lock.wait(timeout=wait if wait is not None else 1.0)

    def _work(self, index: int, batch_fn: Callable[[list[Any]], list[Any]]) -> None:
        while True:
            with self._lock:
                dispatch = self._next(index)
                if dispatch is None:
                    self._lock.notify_all()
                    return
            self._run_batch(batch_fn, dispatch)

    def _run_batch(self, batch_fn: Callable[[list[Any]], list[Any]], dispatch: Dispatch) -> None:
        with self._lock:
            parts, items = zip(*(self._futures.pop(i) for i in dispatch.item_ids), strict=True)
        try:
            outputs = batch_fn(list(items))
        except BaseException as exc:
            outcomes = [(None, exc)] * len(parts)
        else:
            outcomes = [(output, None) for output in outputs]
        finally:
            with self._lock:
                self._pool.finish(dispatch.batch_id)
                self._lock.notify_all()
        for part, (output, exc) in zip(parts, outcomes, strict=True):
            if part.done():
                continue  # cancelled by its caller
            if exc is not None:
                part.set_exception(exc)
            else:
                part.set_result(output)


def _gather(parts: list[concurrent.futures.Future], result: concurrent.futures.Future) -> None:
    """Resolve ``result`` with every part's result, in order, or the first exception among them."""
    remaining = [len(parts)]
    lock = threading.Lock()

    def done(_: concurrent.futures.Future) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        if result.done():
            return
        for part in parts:
            if part.cancelled():
                result.cancel()
                return
            if part.exception() is not None:
                result.set_exception(part.exception())
                return
        result.set_result([part.result() for part in parts])

    for part in parts:
        part.add_done_callback(done)

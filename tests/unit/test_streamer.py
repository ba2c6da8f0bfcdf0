"""zserve.Streamer: in-process batching with the broker's scheduler."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import psutil
import pytest
from streamer_models import PidModel

from zserve import Streamer
from zserve.streamer import OutputCountError


def slow_double(items):
    time.sleep(0.02)
    if "bad" in items:
        raise ZeroDivisionError("bad item")
    return [(i * 2, len(items)) for i in items]


def test_many_threads_get_exactly_their_own_results_in_order_and_batches_form():
    with Streamer(slow_double, max_batch_size=16, max_wait_ms=5) as streamer:
        results: dict[int, list] = {}

        def caller(t):
            results[t] = streamer.predict([t * 100 + k for k in range(5)])

        threads = [threading.Thread(target=caller, args=(t,)) for t in range(32)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    for t in range(32):
        assert [r[0] for r in results[t]] == [2 * (t * 100 + k) for k in range(5)]
    assert max(r[1] for rs in results.values() for r in rs) > 1


def test_an_exception_reaches_only_its_batch_as_the_original_type():
    with Streamer(slow_double, max_batch_size=4, max_wait_ms=50, workers=1) as streamer:
        first = streamer.submit([1])  # takes the idle worker alone
        time.sleep(0.005)
        doomed = [streamer.submit(["bad"]), streamer.submit([2])]  # batched together while the worker is busy
        assert first.result()[0][0] == 2
        for f in doomed:
            with pytest.raises(ZeroDivisionError, match="bad item"):
                f.result()
        assert streamer.predict([3]) == [(6, 1)]  # and the streamer keeps serving


def test_a_batch_function_returning_the_wrong_number_of_outputs_is_a_clear_error():
    with Streamer(lambda items: items[:-1]) as streamer, pytest.raises(OutputCountError, match="0 outputs for 1"):
        streamer.predict(["x"])


def test_async_callers_and_models():
    async def main(streamer):
        return await asyncio.gather(*(streamer.apredict([i]) for i in range(50)))

    with Streamer(slow_double, max_batch_size=64) as streamer:
        results = asyncio.run(main(streamer))
    assert [r[0][0] for r in results] == [2 * i for i in range(50)]


def test_processes_load_the_model_once_each_and_never_in_the_parent(tmp_path):
    with Streamer(PidModel(str(tmp_path)), processes=2, devices=["cpu", "cuda:1"], max_batch_size=8) as streamer:
        pids = set(streamer.worker_pids)
        outputs = []
        threads = [
            threading.Thread(target=lambda i=i: outputs.extend(streamer.predict([i, i + 1000]))) for i in range(40)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        with pytest.raises(KeyError, match="raise was in the batch"):
            streamer.predict(["raise"])
        children = psutil.Process().children()
    setups = {int(p.name.split("-")[1]): p.read_text() for p in tmp_path.iterdir()}
    assert set(setups) == pids and len(pids) == 2 and os.getpid() not in setups
    assert sorted(setups.values()) == ["cpu -", "cuda:0 1"]  # CUDA_VISIBLE_DEVICES per process
    assert sorted(o[0] for o in outputs) == sorted([i for i in range(40)] + [i + 1000 for i in range(40)])
    assert {o[1] for o in outputs} <= pids
    assert all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in children if p.pid in pids)


def test_an_overloaded_submit_queues_nothing_and_the_streamer_keeps_serving():
    from zserve import Overloaded

    with Streamer(slow_double, max_batch_size=4, max_queue=6) as streamer:
        busy = streamer.submit([1])  # the worker takes it at once
        time.sleep(0.005)
        queued = streamer.submit([2, 3, 4, 5])
        with pytest.raises(Overloaded):
            streamer.submit(list(range(10)))  # would pass max_queue: none of it is queued
        assert busy.result()[0][0] == 2 and [r[0] for r in queued.result()] == [4, 6, 8, 10]
        assert streamer.predict([7]) == [(14, 1)]


def test_cost_aware_streamer_keeps_batches_within_the_budget():
    def sizes(items):
        time.sleep(0.01)
        return [(len(i), len(items)) for i in items]

    texts = ["x" * (50 if k % 3 == 0 else 5) for k in range(30)]
    with Streamer(sizes, max_batch_size=16, max_wait_ms=20, max_batch_cost=60, cost=len) as streamer:
        outputs = streamer.predict(texts)
    assert [n for n, _ in outputs] == [len(t) for t in texts]  # order kept
    assert all(batch == 1 for n, batch in outputs if n == 50)  # 2 x 50 > 60
    assert max(batch for _, batch in outputs) <= 12  # 12 x 5 = 60
    with pytest.raises(ValueError, match="cost="):
        Streamer(sizes, max_batch_cost=10)

"""A slow broker does not take its own lag for its workers' silence: liveness and hangs are judged up to when
the broker last heard everything its workers sent (``heard_s``: the out socket found empty), not up to its
clock. Fake clock, the pure core."""

from __future__ import annotations

from test_broker_core import batches, hello, make, replies, result, submit

from zserve.broker.core import MAX_SUBMITS_ITEMS
from zserve.protocol import Heartbeat, Status

LIVENESS_S = 0.5  # test_broker_core's CONFIG: 100 ms x 5


def beat(core, *workers: bytes, now: float) -> None:
    for worker in workers:
        core.on_out(Heartbeat(worker.decode()), [], now)


def test_a_broker_blocked_for_three_liveness_periods_with_heartbeats_waiting_loses_no_worker():
    core = make()
    hello(core, b"w1", credits=1)
    hello(core, b"w2", credits=1)
    for req_id in (1, 2):  # one batch on each worker
        submit(core, b"a", [req_id])
        core.tick(0.0)
    assert len(batches(core.flush()[1])) == 2
    beat(core, b"w1", b"w2", now=0.05)  # the out socket was last found empty here
    # The broker is busy for 3 liveness periods (a burst of Submits handled in one go); the workers keep
    # beating meanwhile, their heartbeats wait in the socket.
    submit(core, b"b", list(range(100, 140)), now=0.1)
    now = 0.05 + 3 * LIVENESS_S
    core.tick(now, heard_s=0.05)
    assert set(core.pool.workers) == {b"w1", b"w2"}
    beat(core, b"w1", b"w2", now=now)  # the heartbeats that waited
    core.tick(now, heard_s=now)
    assert set(core.pool.workers) == {b"w1", b"w2"}
    clients, _ = core.flush()
    assert not [r for r, _ in replies(clients, b"a") if r.status == Status.ENGINE_LOST]
    assert core.pool.in_flight_total() == 2  # nothing was taken from them


def test_judged_by_the_clock_alone_the_same_lag_would_lose_both():
    """What ``heard_s`` prevents (the old rule, still the default for a caller that does not pass it)."""
    core = make()
    hello(core, b"w1")
    hello(core, b"w2")
    beat(core, b"w1", b"w2", now=0.05)
    core.tick(0.05 + 3 * LIVENESS_S)
    assert core.pool.workers == {}


def test_a_silent_worker_is_still_lost_once_the_broker_has_heard_everything():
    core = make()
    hello(core, b"w1", credits=1)
    hello(core, b"w2", credits=1)
    submit(core, b"a", [1])
    core.tick(0.0)
    [b] = batches(core.flush()[1])
    silent = b.worker_id
    alive = b"w2" if silent == b"w1" else b"w1"
    for step in range(1, 8):  # only `alive` beats, and the broker hears it all as it comes
        now = step * 0.1
        beat(core, alive, now=now)
        core.tick(now, heard_s=now)
    assert set(core.pool.workers) == {alive}
    [again] = batches(core.flush()[1])  # the lost worker's batch went to the other one
    assert again.worker_id == alive and again.header.item_ids == b.header.item_ids


def test_a_lagging_broker_judges_silence_up_to_when_it_last_heard():
    core = make()
    hello(core, b"w1")
    beat(core, b"w1", now=0.1)
    core.tick(2.0, heard_s=0.55)  # silent 0.45 s up to the last time the socket was empty: alive
    assert b"w1" in core.pool.workers
    core.tick(2.0, heard_s=0.7)  # silent 0.6 s up to then: lost, however long the broker itself lagged
    assert b"w1" not in core.pool.workers


def test_a_result_waiting_in_the_socket_is_not_a_hang():
    """Hangs too: a worker's progress is judged up to ``heard_s``."""
    core = make()
    hello(core, b"w1", credits=1)
    submit(core, b"a", [1], timeout_ms=60_000)  # a deadline past the three batch timeouts
    core.tick(0.0)
    [b] = batches(core.flush()[1])
    timeout_s = core.batch_timeout_s("m")
    late = timeout_s * 3
    beat(core, b"w1", now=0.05)
    core.tick(late, heard_s=0.05)  # busy for 3 batch timeouts; the result waits in the socket
    assert core.take_kills() == [] and b"w1" in core.pool.workers
    core.on_out(*result(b.header, b"w1"), now=late)
    core.tick(late, heard_s=late)
    assert [r.status for r, _ in replies(core.flush()[0], b"a")] == [Status.OK]
    assert core.take_kills() == []


def test_a_submits_past_the_per_message_bound_is_dropped_whole():
    """A message of 100k items (no zserve client sends one: they split at 1024) would hold the loop for seconds:
    dropped with one log line, nothing queued; a message within the bound is served as usual."""
    core = make()
    submit(core, b"a", list(range(MAX_SUBMITS_ITEMS + 1)))
    assert core.flush() == ([], []) and len(core.requests) == 0
    submit(core, b"a", [1])
    assert core.scheduler.depth("m") == 1

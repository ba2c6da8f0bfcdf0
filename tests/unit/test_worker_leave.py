"""Scale-down without loss, in the broker core: a worker that says Leave gets no more work, what it hands
back is queued again with no attempt counted, it finishes what it computes, and is dismissed (Shutdown)
once it holds nothing. A broker handing over (a broker pod replaced) finishes what workers hold and leaves
the rest to the clients. Driven by a fake clock, as test_broker_core."""

from __future__ import annotations

from test_broker_core import batches, hello, make, replies, result, submit

from zserve.protocol import Leave, Replies, Shutdown, Status


def shutdowns(work) -> list[bytes]:
    return [w.worker_id for w in work if isinstance(w.header, Shutdown)]


def test_a_leaving_worker_finishes_its_batch_hands_back_the_other_and_is_dismissed():
    core = make()  # max_redispatch = 1
    hello(core, b"w1", credits=2)
    submit(core, b"a", [1, 2, 3, 4])
    core.tick(0.0)
    submit(core, b"a", [5, 6, 7, 8], now=0.001)
    core.tick(0.001)
    running, staged = batches(core.flush()[1])
    assert running.worker_id == staged.worker_id == b"w1"

    core.on_work(b"w1", Leave("w1", [staged.header.batch_id]), 0.002)  # staged was never started
    core.tick(0.002)
    _, work = core.flush()
    assert batches(work) == [] and shutdowns(work) == []  # nobody else to take it; w1 still computes `running`
    [health] = [m for m in core.health(1).models if m.name == "m"]
    assert health.ready_workers == 0 and health.queue_depth == 4  # a leaving worker is not ready

    hello(core, b"w2", credits=2, now=0.003)  # the replacement (a scale-up, a new pod)
    core.tick(0.003)
    [again] = batches(core.flush()[1])
    assert again.worker_id == b"w2" and again.header.item_ids == staged.header.item_ids

    core.on_out(*result(running.header, b"w1"), now=0.01)  # w1 finishes what it was computing
    core.tick(0.01)
    clients, work = core.flush()
    assert shutdowns(work) == [b"w1"]  # holds nothing: dismissed
    assert b"w1" not in core.pool.workers
    core.on_out(*result(again.header, b"w2"), now=0.02)
    got = {r.req_id: r for r, _ in replies(clients + core.flush()[0], b"a")}
    assert sorted(got) == list(range(1, 9)) and all(r.status == Status.OK for r in got.values())
    assert all(core.requests.get(i) is None for i in range(1, 9))


def test_a_handed_back_batch_costs_no_attempt():
    core = make()
    core.max_redispatch = 0  # any loss would be answered engine_lost
    hello(core, b"w1", credits=1)
    submit(core, b"a", [1])
    core.tick(0.0)
    [b] = batches(core.flush()[1])
    core.on_work(b"w1", Leave("w1"), 0.001)  # Leave first; then the Batch that crossed it comes back
    core.on_work(b"w1", Leave("w1", [b.header.batch_id]), 0.002)
    core.tick(0.002)
    assert shutdowns(core.flush()[1]) == [b"w1"]
    hello(core, b"w2", credits=1, now=0.003)
    core.tick(0.003)
    [again] = batches(core.flush()[1])
    core.on_out(*result(again.header, b"w2"), now=0.004)
    [(reply, _)] = replies(core.flush()[0], b"a")
    assert reply.status == Status.OK


def test_a_leaving_worker_that_dies_is_lost_as_any_other_and_an_unknown_one_is_dismissed_at_once():
    core = make()
    hello(core, b"w1", credits=1)
    submit(core, b"a", [1])
    core.tick(0.0)
    core.flush()
    core.on_work(b"w1", Leave("w1"), 0.001)
    core.tick(1.0)  # silent past liveness (0.5 s): SIGKILLed after its grace period
    assert b"w1" not in core.pool.workers and core.requests.get(1).attempts == 1
    core.on_work(b"gone", Leave("gone"), 1.0)
    assert shutdowns(core.flush()[1]) == [b"gone"]


def test_a_broker_handing_over_finishes_what_workers_hold_and_leaves_the_queue_to_its_clients():
    core = make()
    hello(core, b"w1", credits=1)
    submit(core, b"a", [1, 2, 3, 4])
    core.tick(0.0)
    [b] = batches(core.flush()[1])
    submit(core, b"a", [5, 6], now=0.001)  # queued behind it
    core.start_draining(0.002, handover=True)
    assert core.health(1).draining is False  # nothing is refused: the frontends stay ready
    submit(core, b"a", [7], now=0.003)  # arrives while handing over: not answered, not queued
    core.tick(0.003)
    clients, work = core.flush()
    assert batches(work) == [] and replies(clients, b"a") == []  # nothing new dispatched, nothing refused
    assert not core.drained(0.004)  # w1 still holds a batch
    core.on_out(*result(b.header, b"w1"), now=0.01)
    assert core.drained(0.01)
    core.shut_down()
    clients, work = core.flush()
    answered = [r.req_id for r, _ in replies(clients, b"a")]
    assert answered == [1, 2, 3, 4] and shutdowns(work) == []  # 5, 6, 7 stay with the client; w1 stays
    assert not [c for c in clients if isinstance(c.header, Replies) and 5 in [r.req_id for r in c.header.items]]

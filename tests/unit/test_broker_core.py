"""The broker core, driven by a fake clock (plain floats) and decoded messages: every rule of the request
lifecycle, without a socket or a process."""

from __future__ import annotations

from zserve.broker.core import BrokerCore, ClientSend, WorkSend
from zserve.config import parse_config
from zserve.protocol import (
    Abort,
    Batch,
    BatchResult,
    Cancel,
    Chunks,
    Codec,
    HealthQuery,
    HealthReport,
    Heartbeat,
    Hello,
    InvalidItem,
    Replace,
    Replies,
    Reply,
    Reset,
    Shutdown,
    Status,
    StepOutput,
    Submit,
    Submits,
)

CONFIG = """
[broker]
heartbeat_interval_ms = 100
heartbeat_liveness = 5
max_redispatch = 1

[[models]]
name = "m"
handler = "x:Y"
max_batch_size = 4
max_wait_ms = 10
max_queue = 8
timeout_ms = 5000

[[models]]
name = "lm"
handler = "x:Y"
timeout_ms = 1000
"""

OK = Status.OK


def make(staged: frozenset[str] = frozenset()) -> BrokerCore:
    return BrokerCore(parse_config(CONFIG), epoch=7, first_batch_id=100, staged=staged, generative=frozenset({"lm"}))


def hello(core: BrokerCore, worker: bytes, model: str = "m", credits: int = 2, role: str = "engine", now=0.0):
    core.on_work(worker, Hello(worker.decode(), 1, role, [model], credits), now)
    core.flush()  # the welcome


def submit(core: BrokerCore, client: bytes, req_ids: list[int], model: str = "m", now: float = 0.0, **kw) -> None:
    items = [Submit(r, model, **kw) for r in req_ids]
    core.on_client(client, Submits(items, [1] * len(items)), [f"p{r}".encode() for r in req_ids], now)


def batches(work: list[WorkSend]) -> list[WorkSend]:
    return [w for w in work if isinstance(w.header, Batch)]


def replies(clients: list[ClientSend], client: bytes) -> list[tuple[Reply, list]]:
    """Every reply one client got, with its frames (checks that the counts split the frames exactly)."""
    out = []
    for send in clients:
        if send.identity == client and isinstance(send.header, Replies):
            offset = 0
            for reply, count in zip(send.header.items, send.header.frame_counts, strict=True):
                out.append((reply, send.frames[offset : offset + count]))
                offset += count
            assert offset == len(send.frames)
    return out


def result(batch: Batch, worker: bytes, statuses=None, frames=None) -> tuple[BatchResult, list]:
    n = len(batch.item_ids)
    statuses = statuses or [OK] * n
    frames = frames if frames is not None else [f"out{i}".encode() for i in batch.item_ids]
    counts = [1 if s == OK else 0 for s in statuses]
    return BatchResult(batch.batch_id, worker.decode(), statuses, [""] * n, [""] * n, counts, 2.0), frames


def test_one_message_per_client_per_batch_result():
    core = make()
    hello(core, b"w")
    submit(core, b"a", [1, 2])
    submit(core, b"b", [1, 2])
    core.tick(0.0)  # the idle worker takes what is there at once
    _, work = core.flush()
    [b] = batches(work)
    assert b.header.item_ids and len(b.header.item_ids) == 4
    assert b.frames == [b"p1", b"p2", b"p1", b"p2"]
    core.on_out(*result(b.header, b"w"), now=0.01)
    clients, _ = core.flush()
    assert [(c.identity, type(c.header)) for c in clients] == [(b"a", Replies), (b"b", Replies)]
    got = replies(clients, b"a")
    assert [(r.req_id, r.status, r.batch_size, f) for r, f in got] == [(1, OK, 4, [b"out1"]), (2, OK, 4, [b"out2"])]
    assert len(core.requests) == 0


def test_batch_full_by_count_or_by_waiting_time():
    core = make()
    hello(core, b"w", credits=2)
    submit(core, b"a", [0])
    core.tick(0.0)
    core.flush()  # the worker holds one batch now: the next must fill or wait
    submit(core, b"a", [1, 2], now=0.001)
    core.tick(0.002)
    assert batches(core.flush()[1]) == []
    assert abs(core.next_wakeup_s(0.002) - 0.009) < 1e-6  # the window of the oldest item closes at 0.011
    core.tick(0.0111)
    [b] = batches(core.flush()[1])
    assert len(b.header.item_ids) == 2


def test_overload_unknown_model_stream_on_batch_model_and_draining_are_refused_at_once():
    core = make()
    submit(core, b"a", list(range(10)))  # max_queue 8, no worker yet
    submit(core, b"a", [20], model="nope")
    submit(core, b"a", [21], stream=True)
    got = {r.req_id: r for r, _ in replies(core.flush()[0], b"a")}
    assert [got[i].status for i in (8, 9)] == [Status.OVERLOADED] * 2
    assert got[20].status == Status.UNKNOWN_MODEL and "'nope'" in got[20].message
    assert got[21].status == Status.BAD_REQUEST and "not generative" in got[21].message
    assert len(core.requests) == 8
    core.start_draining(1.0)
    submit(core, b"a", [30], now=1.0)
    [(r, _)] = replies(core.flush()[0], b"a")
    assert r.status == Status.SHUTTING_DOWN
    assert not core.drained(1.0) and core.drained(1.0 + core.config.broker.drain_timeout_s + 0.1)


def test_a_malformed_item_fails_alone_and_bad_frame_counts_fail_the_message():
    core = make()
    hello(core, b"w", credits=1)
    items = [
        Submit(1, "m"),
        InvalidItem(2, "malformed request: Expected `str`"),
        InvalidItem(None, "?"),
        Submit(3, "m"),
    ]
    core.on_client(b"a", Submits(items, [1, 1, 1, 1]), [b"p1", b"p2", b"p?", b"p3"], 0.0)
    core.tick(0.0)
    clients, work = core.flush()
    [(r, _)] = replies(clients, b"a")
    assert r.req_id == 2 and r.status == Status.BAD_REQUEST and "Expected" in r.message
    [b] = batches(work)
    assert b.header.item_ids == [1, 2] and b.frames == [b"p1", b"p3"]  # item ids, and 3's frame stayed aligned
    core.on_client(b"a", Submits([Submit(4, "m"), Submit(5, "m")], [1, 2]), [b"x", b"y"], 0.0)
    assert {r.req_id: r.status for r, _ in replies(core.flush()[0], b"a")} == {
        4: Status.BAD_REQUEST,
        5: Status.BAD_REQUEST,
    }
    core.on_client(b"a", Submits([Submit(6, "m")], [0]), [], 0.0)
    [(r, _)] = replies(core.flush()[0], b"a")
    assert r.status == Status.BAD_REQUEST and "no payload" in r.message


def test_codec_salvages_the_valid_items_of_a_submits():
    import msgspec

    codec = Codec()
    raw = msgspec.msgpack.encode([7, [[1, 1, "m"], [1, 2, 42], [1, "x"], [1, 4, "m", 5]], [1, 1, 1, 1]])
    msg = codec.decode(raw, "test")
    assert isinstance(msg, Submits) and msg.frame_counts == [1, 1, 1, 1]
    assert msg.items[0] == Submit(1, "m") and msg.items[3] == Submit(4, "m", 5)
    assert isinstance(msg.items[1], InvalidItem) and msg.items[1].req_id == 2
    assert isinstance(msg.items[2], InvalidItem) and msg.items[2].req_id is None
    assert codec.decode(msgspec.msgpack.encode([7, "nope", [1]])) is None
    assert codec.decode(b"\xc1garbage") is None


def test_empty_and_large_submits():
    core = make()
    core.on_client(b"a", Submits([], []), [], 0.0)
    assert core.flush() == ([], [])
    hello(core, b"w", credits=200)
    core.config.models[0].max_queue = 1000
    core.scheduler.policies["m"] = core.scheduler.policies["m"].__class__(4, 10.0, 1000)
    submit(core, b"a", list(range(500)))
    core.tick(0.0)
    work = batches(core.flush()[1])
    assert sum(len(w.header.item_ids) for w in work) == 500
    for w in work:
        core.on_out(*result(w.header, b"w"), now=0.01)
    clients, _ = core.flush()
    assert len(clients) == 1  # 125 batch results, one message
    got = replies(clients, b"a")
    assert sorted(r.req_id for r, _ in got) == list(range(500)) and all(r.status == OK for r, _ in got)


def test_lost_worker_batches_are_redispatched_once_then_engine_lost():
    core = make()
    hello(core, b"w1", credits=1)
    submit(core, b"a", [1, 2])
    core.tick(0.0)
    [b1] = batches(core.flush()[1])
    hello(core, b"w2", credits=1, now=0.1)
    core.tick(0.6)  # w1 silent for 5 heartbeat intervals: lost, its batch goes to w2
    [b2] = batches(core.flush()[1])
    assert b2.worker_id == b"w2" and b2.header.item_ids == b1.header.item_ids and b2.frames == b1.frames
    core.on_out(*result(b1.header, b"w1"), now=0.61)  # a late result of the lost batch: dropped
    assert replies(core.flush()[0], b"a") == []
    core.on_out(Heartbeat("w2"), [], now=0.6)
    core.tick(1.2)  # w2 lost too: second loss of the same items
    got = replies(core.flush()[0], b"a")
    assert [r.status for r, _ in got] == [Status.ENGINE_LOST] * 2 and "gave up after 2 attempts" in got[0][0].message


def test_undelivered_batch_requeued_without_an_attempt():
    core = make()
    hello(core, b"w1", credits=1)
    hello(core, b"w2", credits=1)
    submit(core, b"a", [1])
    core.tick(0.0)
    [b] = batches(core.flush()[1])
    core.worker_unreachable(b.worker_id, [b.header.batch_id])
    core.tick(0.0)
    [again] = batches(core.flush()[1])
    assert again.worker_id != b.worker_id
    assert core.requests.find(b"a", 1).attempts == 0


def test_cancel_while_queued_and_while_in_flight():
    core = make()
    hello(core, b"w", credits=1)
    submit(core, b"a", [1])
    core.tick(0.0)
    [b] = batches(core.flush()[1])
    submit(core, b"a", [2])
    core.on_client(b"a", Cancel(2), [], 0.0)
    core.on_client(b"a", Cancel(1), [], 0.0)
    core.on_client(b"a", Cancel(99), [], 0.0)  # unknown: ignored
    got = replies(core.flush()[0], b"a")
    assert [(r.req_id, r.status) for r, _ in got] == [(2, Status.CANCELLED), (1, Status.CANCELLED)]
    core.on_out(*result(b.header, b"w"), now=0.1)  # still computed; its result is dropped
    assert replies(core.flush()[0], b"a") == []
    core.tick(0.1)
    assert batches(core.flush()[1]) == []  # 2 never reached the engine


def test_deadlines_queued_and_in_flight():
    core = make()
    hello(core, b"w", credits=1)
    submit(core, b"a", [1], timeout_ms=50)
    core.tick(0.0)
    core.flush()
    submit(core, b"a", [2], timeout_ms=30, now=0.01)
    assert abs(core.next_wakeup_s(0.01) - 0.03) < 1e-9  # 2's deadline; no batching timer without credit
    core.tick(0.045)  # 2's deadline (0.04) passed in the queue
    core.on_out(Heartbeat("w"), [], now=0.045)
    core.tick(0.06)  # 1's (0.05) passed in the worker
    got = {r.req_id: r for r, _ in replies(core.flush()[0], b"a")}
    assert "in the queue" in got[2].message and "in a worker" in got[1].message
    assert {r.status for r in got.values()} == {Status.DEADLINE_EXCEEDED}


def test_result_with_too_few_statuses_fails_the_rest_at_once():
    core = make()
    hello(core, b"w")
    submit(core, b"a", [1, 2, 3])
    core.tick(0.0)
    [b] = batches(core.flush()[1])
    short = BatchResult(b.header.batch_id, "w", [OK], [""], [""], [1], 1.0)
    core.on_out(short, [b"only"], now=0.01)
    got = {r.req_id: (r.status, f) for r, f in replies(core.flush()[0], b"a")}
    assert got == {1: (OK, [b"only"]), 2: (Status.INTERNAL, []), 3: (Status.INTERNAL, [])}
    assert len(core.requests) == 0


def test_result_with_too_few_frames_fails_those_items():
    core = make()
    hello(core, b"w")
    submit(core, b"a", [1, 2])
    core.tick(0.0)
    [b] = batches(core.flush()[1])
    lying = BatchResult(b.header.batch_id, "w", [OK, OK], ["", ""], ["", ""], [1, 1], 1.0)
    core.on_out(lying, [b"one"], now=0.01)
    got = {r.req_id: r.status for r, _ in replies(core.flush()[0], b"a")}
    assert got == {1: OK, 2: Status.INTERNAL}


def test_prepared_batch_keeps_items_answered_meanwhile_aligned():
    core = make(staged=frozenset({"m"}))
    hello(core, b"s", role="preprocess", credits=1)
    hello(core, b"e", credits=1)
    submit(core, b"a", [1, 2, 3])
    core.tick(0.0)
    [to_stage] = batches(core.flush()[1])
    assert to_stage.worker_id == b"s"
    core.on_client(b"a", Cancel(2), [], 0.0)  # answered while in the stage
    statuses = [OK, OK, Status.BAD_REQUEST]
    stage_result = BatchResult(to_stage.header.batch_id, "s", statuses, ["", "", "bad"], ["", "", "text"], [0, 0, 0])
    stage_result.prepared_frames = 1
    core.on_out(stage_result, [b"prepared"], now=0.01)
    core.tick(0.01)
    clients, work = core.flush()
    got = {r.req_id: r for r, _ in replies(clients, b"a")}
    assert got[2].status == Status.CANCELLED and got[3].status == Status.BAD_REQUEST and got[3].field == "text"
    [to_engine] = batches(work)
    assert to_engine.worker_id == b"e" and to_engine.header.prepared and to_engine.frames == [b"prepared"]
    assert len(to_engine.header.item_ids) == 2  # 2's row is in the payload: its id stays, its result is dropped
    core.on_out(*result(to_engine.header, b"e"), now=0.02)
    [(r, frames)] = replies(core.flush()[0], b"a")
    assert r.req_id == 1 and r.status == OK and frames == [b"out1"]


def step(batch_ids, texts, finished, statuses=None, frames_per=None, worker="g") -> StepOutput:
    n = len(batch_ids)
    return StepOutput(
        worker, batch_ids, texts, [1] * n, finished, statuses or [OK] * n, [""] * n, frames_per or [0] * n
    )


def test_streams_get_one_chunks_message_per_step_then_the_reply_and_aborts_on_cancel():
    core = make()
    hello(core, b"g", model="lm", credits=4)
    submit(core, b"a", [1, 2], model="lm", stream=True)
    submit(core, b"b", [1], model="lm", stream=True)
    core.tick(0.0)
    seqs = {tuple(w.header.item_ids): w.header.batch_id for w in batches(core.flush()[1])}
    ids = list(seqs.values())
    assert len(ids) == 3  # a sequence is a batch of one, dispatched at once
    core.on_out(step(ids, ["He", "Hi", "Yo"], [False] * 3), [], now=0.01)
    clients, _ = core.flush()
    assert [(c.identity, type(c.header)) for c in clients] == [(b"a", Chunks), (b"b", Chunks)]
    assert [c.text for c in clients[0].header.items] == ["He", "Hi"]
    core.on_out(step(ids[:1], ["llo"], [True], frames_per=[1]), [b"resp"], now=0.02)
    clients, _ = core.flush()
    assert [type(c.header) for c in clients] == [Chunks, Replies]  # the last text before the reply
    core.on_client(b"a", Cancel(2), [], 0.03)
    _, work = core.flush()
    assert [w.header for w in work] == [Abort([ids[1]])]
    core.client_unreachable(b"b")  # its socket is gone: the sequence is aborted, nothing left for it
    _, work = core.flush()
    assert [w.header for w in work] == [Abort([ids[2]])] and len(core.requests) == 0
    assert core.pool.in_flight_items("lm") == 0


def test_engine_lost_redispatches_unstreamed_sequences_and_ends_streamed_ones():
    core = make()
    hello(core, b"g", model="lm", credits=4)
    submit(core, b"a", [1], model="lm", stream=True)
    submit(core, b"a", [2], model="lm")
    core.tick(0.0)
    ids = [w.header.batch_id for w in batches(core.flush()[1])]
    core.on_out(step(ids, ["x", ""], [False, False]), [], now=0.01)
    core.flush()
    hello(core, b"g2", model="lm", credits=4, now=0.2)
    core.tick(0.7)  # g lost
    clients, work = core.flush()
    [(r, _)] = replies(clients, b"a")
    assert r.req_id == 1 and r.status == Status.ENGINE_LOST and "while streaming" in r.message
    [again] = batches(work)
    assert again.worker_id == b"g2"


def test_malformed_step_output_fails_the_sequences_it_does_not_account_for():
    core = make()
    hello(core, b"g", model="lm", credits=4)
    submit(core, b"a", [1, 2], model="lm")
    core.tick(0.0)
    ids = [w.header.batch_id for w in batches(core.flush()[1])]
    bad = StepOutput("g", ids, ["", ""], [1, 1], [True, True], [OK], [""], [0])  # one status for two
    core.on_out(bad, [], now=0.01)
    clients, work = core.flush()
    got = {r.req_id: r.status for r, _ in replies(clients, b"a")}
    assert got == {1: OK, 2: Status.INTERNAL}
    assert [w.header for w in work] == [Abort([ids[1]])]


def test_health_unknown_worker_heartbeats_and_shutdown():
    core = make()
    hello(core, b"w", credits=2)
    submit(core, b"a", [1, 2, 3])
    core.on_client(b"h", HealthQuery(5), [], 0.0)
    clients, _ = core.flush()
    [report] = [c.header for c in clients if c.identity == b"h"]
    assert isinstance(report, HealthReport) and report.query_id == 5 and report.epoch == 7
    m = {x.name: x for x in report.models}["m"]
    assert (m.ready_workers, m.queue_depth, m.in_flight) == (1, 3, 0)
    core.on_out(Heartbeat("stranger"), [], now=0.0)
    core.tick(0.0)
    _, work = core.flush()
    assert any(w.worker_id == b"stranger" and isinstance(w.header, Reset) for w in work)
    assert any(w.worker_id == b"w" and isinstance(w.header, Heartbeat) for w in work)
    core.tick(0.05)
    assert not any(isinstance(w.header, Heartbeat) for w in core.flush()[1])  # next beat at 0.1
    core.shut_down()
    clients, work = core.flush()
    assert {r.status for r, _ in replies(clients, b"a")} == {Status.SHUTTING_DOWN}
    assert [w.header for w in work] == [Shutdown("broker stopping")]


def test_worker_restart_orphans_its_batches():
    core = make()
    hello(core, b"w", credits=1)
    submit(core, b"a", [1])
    core.tick(0.0)
    [b] = batches(core.flush()[1])
    hello(core, b"w", credits=1, now=0.1)  # the same identity says Hello again: what it held is lost
    core.tick(0.1)
    [again] = batches(core.flush()[1])
    assert again.header.item_ids == b.header.item_ids and again.header.batch_id != b.header.batch_id


def test_health_reports_credits_batch_sizes_latencies_and_engine_counters():
    core = make()
    hello(core, b"w", credits=2)
    core.on_work(b"g", Hello("g", 1, "engine", ["lm"], 8, kv_blocks=100), 0.0)
    for t, ids in ((0.0, [1, 2, 3, 4]), (0.2, [5, 6])):
        submit(core, b"a", ids, now=t)
        core.tick(t)
        [b] = batches(core.flush()[1])
        core.on_out(*result(b.header, b"w"), now=t + 0.010 * len(ids))
    submit(core, b"a", [9], model="lm", now=0.3)
    core.tick(0.3)
    [seq] = batches(core.flush()[1])
    out = step([seq.header.batch_id], [""], [False])
    out.steps, out.batch_tokens, out.preemptions, out.prompt_tokens, out.cached_prompt_tokens = 3, 48, 1, 40, 32
    core.on_out(out, [], now=0.35)
    models = {m.name: m for m in core.health(1).models}
    m, lm = models["m"], models["lm"]
    assert (m.credits, m.free_credits, m.batches, m.mean_batch_size) == (2, 2, 2, 3.0)
    assert abs(m.latency_p50_ms - 40.0) < 1e-6 and abs(m.latency_p99_ms - 40.0) < 1e-6  # 4 at 40 ms, 2 at 20 ms
    assert abs(min(m.latency_p50_ms, m.latency_p90_ms) - 40.0) < 1e-6
    assert (lm.kv_blocks, lm.credits, lm.free_credits, lm.running_sequences) == (100, 8, 7, 1)
    assert (lm.engine_steps, lm.batch_tokens, lm.preemptions, lm.prompt_tokens, lm.cached_prompt_tokens) == (
        3, 48, 1, 40, 32,
    )  # fmt: skip


def test_a_resubmitted_request_that_is_still_pending_is_answered_once():
    core = make()
    hello(core, b"w", credits=1)
    submit(core, b"a", [1])
    submit(core, b"a", [1])  # the client thought the broker lost it
    core.tick(0.0)
    clients, work = core.flush()
    assert clients == [] and len(core.requests) == 1
    [b] = batches(work)
    core.on_out(*result(b.header, b"w"), now=0.01)
    assert [r.req_id for r, _ in replies(core.flush()[0], b"a")] == [1]


def test_a_worker_without_progress_past_batch_timeout_is_hung_killed_and_ignored():
    core = make()
    core.config.models[0].batch_timeout_s = None
    assert core.batch_timeout_s("m") == 5.0  # derived: timeout_ms, until batches are measured
    core.hangs.batch_timeouts_s["m"] = 2.0
    hello(core, b"w1:11", credits=2)
    submit(core, b"a", [1])
    core.tick(0.0)
    [b] = batches(core.flush()[1])
    for t in (0.4, 0.8, 1.2, 1.6, 2.0):  # its heartbeat thread lives on: only the lack of progress tells
        core.on_out(Heartbeat("w1:11"), [], now=t)
        core.tick(t)
    assert core.take_kills() == [] and b"w1:11" in core.pool.workers
    hello(core, b"w2:12", credits=2, now=2.0)
    core.on_out(Heartbeat("w1:11"), [], now=2.1)
    core.tick(2.1)
    assert core.take_kills() == [(1, "w1:11")] and b"w1:11" not in core.pool.workers
    _, work = core.flush()
    [again] = batches(work)
    assert again.worker_id == b"w2:12" and again.header.item_ids == b.header.item_ids
    [told] = [w for w in work if isinstance(w.header, Replace)]  # for a worker on a host the shell cannot kill
    assert told.worker_id == b"w1:11" and "no progress for 2.1s" in told.header.reason
    core.on_out(Heartbeat("w1:11"), [], now=2.2)  # no Reset: it must not register again
    core.on_work(b"w1:11", Hello("w1:11", 1, "engine", ["m"], 2), 2.2)
    core.tick(2.2)
    assert b"w1:11" not in core.pool.workers and not any(isinstance(w.header, Reset) for w in core.flush()[1])
    assert {m.name: m for m in core.health(0).models}["m"].workers_hung == 1
    core.on_out(*result(again.header, b"w2:12"), now=2.3)
    [(r, _)] = replies(core.flush()[0], b"a")
    assert r.status == OK


def test_costs_from_submits_drive_a_cost_batched_model_and_survive_a_lost_worker():
    config = parse_config(CONFIG.replace("max_queue = 8", "max_queue = 8\nmax_batch_cost = 100"))
    core = BrokerCore(config, epoch=7, first_batch_id=100, generative=frozenset({"lm"}))
    hello(core, b"w", credits=1)
    submit(core, b"a", [1], cost=90)
    submit(core, b"a", [2, 3], cost=40)
    core.tick(0.0)
    [b] = batches(core.flush()[1])
    assert [core.requests.get(i).req_id for i in b.header.item_ids] == [1]  # 2 x 90 > 100: alone
    core.worker_unreachable(b"w")  # lost: re-dispatched with its cost
    hello(core, b"w2", credits=1)
    core.tick(0.0)
    [b] = batches(core.flush()[1])
    assert [core.requests.get(i).req_id for i in b.header.item_ids] == [1]
    health = core.health(1).models[0]
    assert (health.batched_cost, health.padded_cost) == (180, 180)


def test_a_request_the_queue_would_keep_past_its_deadline_is_refused_at_once():
    core = make()
    hello(core, b"w", credits=1)
    submit(core, b"a", [1])
    core.tick(0.0)
    [b] = batches(core.flush()[1])
    core.on_out(*result(b.header, b"w"), now=0.1)  # compute_ms 2.0 for 1 item: 2 ms per item
    core.flush()
    submit(core, b"a", [2, 3], now=0.1, timeout_ms=1000)  # 2 ms each: well within a second
    assert replies(core.flush()[0], b"a") == []
    core.stats["m"].item_s = core.stats["m"].drain_s_per_item = 0.1  # now 100 ms per item, one engine
    submit(core, b"a", [4, 5, 6], now=0.1, timeout_ms=5000)  # 5 queued: 500 ms, fine
    submit(core, b"a", [7], now=0.1, timeout_ms=300)  # 5 ahead x 100 ms > 300 ms
    [(r, _)] = replies(core.flush()[0], b"a")
    assert r.req_id == 7 and r.status == Status.OVERLOADED and "past this request's 300 ms deadline" in r.message
    assert core.scheduler.depth("m") == 5 and core.requests.find(b"a", 7) is None


def test_the_batch_that_hung_goes_again_one_item_per_batch_and_only_the_hanging_item_is_lost():
    core = make()
    core.hangs.batch_timeouts_s["m"] = 1.0
    hello(core, b"w1:11", credits=1)
    submit(core, b"a", [1, 2, 3])
    core.tick(0.0)
    [b] = batches(core.flush()[1])
    assert len(b.header.item_ids) == 3
    for t in (0.4, 0.8):
        core.on_out(Heartbeat("w1:11"), [], now=t)
    hello(core, b"w2:12", credits=1, now=1.0)
    core.tick(1.1)  # w1 hung: the three go again, alone; a newer request waits behind them
    assert core.take_kills() == [(1, "w1:11")]
    submit(core, b"a", [4], now=1.1)
    done = {}
    now = 1.1
    while len(done) < 4 and now < 10:
        for worker in list(core.pool.workers):  # hung or not, every worker's heartbeat thread lives on
            core.on_out(Heartbeat(worker.decode()), [], now=now)
        core.tick(now)
        clients, work = core.flush()
        for r, _ in replies(clients, b"a"):
            done[r.req_id] = r.status
        for send in batches(work):
            ids = send.header.item_ids
            reqs = [core.requests.get(i).req_id for i in ids]
            if 2 in reqs:  # the item that hangs: its worker makes no progress again
                assert reqs == [2]
                hello(core, b"w3:13", credits=1, now=now)
                continue
            assert len(ids) == 1 or 4 in reqs  # the hung batch's items each alone; the new one as usual
            core.on_out(*result(send.header, send.worker_id), now=now)
        for r, _ in replies(core.flush()[0], b"a"):
            done[r.req_id] = r.status
        now += 0.3
    assert done == {1: OK, 2: Status.ENGINE_LOST, 3: OK, 4: OK}


def test_a_worker_stalled_on_a_suspect_is_hung_after_a_few_batch_times_not_a_whole_batch_timeout():
    core = make()
    core.hangs.batch_timeouts_s["m"] = 2.0
    hello(core, b"w1:11", credits=1)
    submit(core, b"a", [1, 2])
    core.tick(0.0)
    assert len(batches(core.flush()[1])) == 1
    core.stats["m"].slowest_batch_s = 0.3  # as if measured: a suspect may take 4 x 0.3 s
    hello(core, b"w2:12", credits=1, now=2.0)
    core.on_out(Heartbeat("w1:11"), [], now=2.1)
    core.tick(2.1)
    assert core.take_kills() == [(1, "w1:11")]
    [alone] = batches(core.flush()[1])
    assert alone.worker_id == b"w2:12" and [core.requests.get(i).req_id for i in alone.header.item_ids] == [1]

    def beat(now: float) -> list[tuple[int, str]]:
        for worker in list(core.pool.workers):
            core.on_out(Heartbeat(worker.decode()), [], now=now)
        core.tick(now)
        return core.take_kills()

    assert beat(2.8) == [] and beat(3.25) == []  # 1.15 s on the suspect: not yet
    assert beat(3.35) == [(1, "w2:12")]  # past 4 x 0.3 s, long before batch_timeout_s
    [(r, _)] = replies(core.flush()[0], b"a")
    assert r.req_id == 1 and r.status == Status.ENGINE_LOST  # its second attempt
    hello(core, b"w3:13", credits=1, now=3.4)
    core.tick(3.4)
    [alone] = batches(core.flush()[1])  # the innocent batch-mate, alone, answered as usual
    core.on_out(*result(alone.header, b"w3:13"), now=3.5)
    [(r, _)] = replies(core.flush()[0], b"a")
    assert r.req_id == 2 and r.status == OK
    submit(core, b"a", [3], now=3.5)
    core.tick(3.5)
    assert len(batches(core.flush()[1])) == 1  # no suspect in it: the whole batch_timeout_s applies
    assert beat(5.0) == [] and beat(5.6) == [(1, "w3:13")]
    core.stats["m"].slowest_batch_s = 0.0  # nothing measured: SUSPECT_FLOOR_S (0.5 s) for the suspect
    hello(core, b"w4:14", credits=1, now=5.6)
    core.tick(5.6)
    [alone] = batches(core.flush()[1])
    assert [core.requests.get(i).req_id for i in alone.header.item_ids] == [3]
    assert beat(6.05) == [] and beat(6.15) == [(1, "w4:14")]

"""The clients' pending table: dispatch of coalesced Replies/Chunks, local deadlines, broker loss."""

from __future__ import annotations

from zserve.client.pending import BROKER_SILENCE_S, PING_INTERVAL_S, PendingTable
from zserve.errors import BrokerUnavailable, DeadlineExceeded, EngineLost, ModelError
from zserve.protocol import Chunk, Chunks, HealthReport, Replies, Reply, Status, Submit


class Recorder:
    def __init__(self) -> None:
        self.texts: list[str] = []
        self.replies: list[tuple[Reply, list]] = []
        self.errors: list[Exception] = []

    def chunk(self, chunk: Chunk) -> None:
        self.texts.append(chunk.text)

    def reply(self, reply: Reply, frames: list) -> None:
        self.replies.append((reply, frames))

    def fail(self, error: Exception) -> None:
        self.errors.append(error)


def table_with(n: int, timeout_ms: int = 0, now: float = 0.0) -> tuple[PendingTable, list[int], list[Recorder]]:
    t = PendingTable("ipc://x")
    ids = [t.new_id() for _ in range(n)]
    waiters = [Recorder() for _ in ids]
    for i, w in zip(ids, waiters, strict=True):
        t.add(Submit(i, "m", timeout_ms), [f"p{i}".encode()], w, now)
    return t, ids, waiters


def test_replies_split_frames_by_count_and_resolve_each_request_once():
    t, (a, b, c), (wa, wb, wc) = table_with(3)
    msg = Replies([Reply(b, Status.OK), Reply(a, Status.BAD_REQUEST, "no"), Reply(c, Status.OK)], [2, 0, 1])
    t.dispatch(msg, [b"b0", b"b1", b"c0"], now=1.0)
    assert (
        wb.replies == [(Reply(b, Status.OK), [b"b0", b"b1"])] and wa.replies[0][1] == [] and wc.replies[0][1] == [b"c0"]
    )
    t.dispatch(msg, [b"b0", b"b1", b"c0"], now=1.0)  # a duplicate answers nobody twice
    assert len(wb.replies) == 1 and len(t) == 0


def test_misaligned_replies_fail_their_requests_with_a_typed_error():
    t, (a, b), (wa, wb) = table_with(2)
    t.dispatch(Replies([Reply(a, Status.OK), Reply(b, Status.OK)], [1, 1]), [b"only one"], now=0.0)
    assert [type(e) for e in wa.errors + wb.errors] == [ModelError, ModelError] and not wa.replies


def test_chunks_reach_their_stream_and_unknown_ids_are_ignored():
    t, (a,), (wa,) = table_with(1)
    t.dispatch(Chunks([Chunk(a, "He"), Chunk(12345, "zz"), Chunk(a, "llo")]), [], now=0.0)
    assert wa.texts == ["He", "llo"] and a in t


def test_local_deadline_guard():
    t, (a, b), (wa, wb) = table_with(2, timeout_ms=100)
    assert t.expired(1.0) == []  # guard = 0.1 s + 1 s of grace
    assert t.expired(1.2) == [a, b]
    assert all(isinstance(w.errors[0], DeadlineExceeded) for w in (wa, wb)) and len(t) == 0


def test_broker_restart_resubmits_what_it_lost_within_the_deadline():
    t, (a, b, c), (wa, wb, wc) = table_with(3, timeout_ms=2000, now=0.0)
    seen = []
    qid = t.add_health_query(seen.append)
    assert t.dispatch(HealthReport(qid, epoch=1, draining=False), [], now=0.5) == [] and seen
    t.dispatch(Chunks([Chunk(c, "text so far")]), [], now=0.6)
    resend = t.dispatch(HealthReport(0, epoch=2, draining=False), [], now=1.5)  # another epoch: a restart
    assert [(s.req_id, s.timeout_ms, f) for s, f in resend] == [
        (a, 500, [f"p{a}".encode()]),
        (b, 500, [f"p{b}".encode()]),
    ]
    assert isinstance(wc.errors[0], EngineLost) and "streaming" in wc.errors[0].message  # its text would repeat
    assert not wa.errors and a in t and c not in t
    t.dispatch(Replies([Reply(a, Status.OK)], [1]), [b"out"], now=1.6)  # the new broker answers: once
    assert wa.replies == [(Reply(a, Status.OK), [b"out"])]
    assert t.dispatch(HealthReport(0, epoch=2, draining=False), [], now=1.7) == []  # the new broker's: no restart
    late = t.dispatch(HealthReport(0, epoch=3, draining=False), [], now=2.1)  # b's deadline has passed
    assert late == [] and isinstance(wb.errors[0], DeadlineExceeded)


def test_broker_silence_fails_everything_pending():
    t2, _, (wb,) = table_with(1, now=10.0)
    assert t2.ping_due(10.0 + PING_INTERVAL_S)
    assert not t2.ping_due(10.0 + PING_INTERVAL_S + 0.1)  # one ping per interval
    assert not t2.ping_due(10.0 + BROKER_SILENCE_S + 0.1)
    assert isinstance(wb.errors[0], BrokerUnavailable) and len(t2) == 0
    assert not t2.ping_due(100.0)  # nothing pending: no pings

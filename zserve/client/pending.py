"""The pending table both clients share: request ids, local deadline guards, the broker's epoch and
liveness, and dispatch of the broker's coalesced Replies and Chunks to whoever waits for each request. No
sockets and no clock of its own (``now`` is passed in): the sync and async clients own the sockets.

Every pending request keeps its Submit and payload frames until it is answered: when the broker restarts
(its epoch changes), the requests it lost are sent again to the new one, within their deadlines, so a broker
crash loses nothing. A streamed request whose text had begun to arrive is the exception: it ends
``EngineLost`` (a second run would repeat the text).

Each request waits through a ``Waiter``: the sync client's resolves a ``concurrent.futures.Future`` on its
IO thread, the async client's an ``asyncio.Future``, a stream's feeds a queue of text deltas.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from zserve import payload
from zserve.errors import BrokerUnavailable, DeadlineExceeded, EngineLost, ModelError, ZserveError, error_for
from zserve.protocol import Chunk, Chunks, HealthReport, Msg, Replies, Reply, Status, Submit

log = logging.getLogger("zserve.client")

PING_INTERVAL_S = 1.0
BROKER_SILENCE_S = 5.0  # pending requests fail after this long without a word from the broker
DEADLINE_GRACE_S = 1.0  # the broker answers DEADLINE_EXCEEDED itself; the local guard only covers its loss


@dataclass(slots=True)
class Answer:
    """A successful reply with its serving metadata."""

    value: Any
    batch_size: int
    queue_ms: float
    compute_ms: float


def answer_of(reply: Reply, frames: list[Any]) -> Answer:
    """The Answer a Reply carries, or its typed error (raised)."""
    if reply.status != Status.OK:
        raise error_for(Status(reply.status), reply.message, reply.field, reply.retry_after_ms)
    return Answer(payload.decode(frames), reply.batch_size, reply.queue_ms, reply.compute_ms)


class Waiter(Protocol):
    """Who waits for one request. Called by the table, at most one of ``reply``/``fail``, once."""

    def chunk(self, chunk: Chunk) -> None: ...  # streamed requests: new text (and its logprobs)

    def reply(self, reply: Reply, frames: list[Any]) -> None: ...

    def fail(self, error: ZserveError) -> None: ...


@dataclass(slots=True)
class _Entry:
    waiter: Waiter
    guard_s: float | None  # answered DeadlineExceeded locally past this (the broker's own answer is lost)
    submit: Submit
    frames: list[Any]  # kept for a resubmission after a broker restart
    streamed: bool = False  # text has arrived: it cannot be resubmitted


class PendingTable:
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._ids = itertools.count(random.getrandbits(20) << 32)
        self._entries: dict[int, _Entry] = {}
        self._health: dict[int, Callable[[HealthReport], None]] = {}
        self._query_ids = itertools.count(1)
        self.epoch: int | None = None  # the broker's, from its last HealthReport
        self.last_heard_s = 0.0
        self.last_ping_s = 0.0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, req_id: int) -> bool:
        return req_id in self._entries

    def new_id(self) -> int:
        return next(self._ids)

    def add(self, submit: Submit, frames: list[Any], waiter: Waiter, now: float) -> None:
        if not self._entries:
            self.last_heard_s = now  # silence is measured from the first pending request
        guard = now + submit.timeout_ms / 1000.0 + DEADLINE_GRACE_S if submit.timeout_ms else None
        self._entries[submit.req_id] = _Entry(waiter, guard, submit, frames)

    def discard(self, req_id: int) -> Waiter | None:
        """Forget a request (cancelled by the caller); its waiter, if it was pending."""
        entry = self._entries.pop(req_id, None)
        return None if entry is None else entry.waiter

    def add_health_query(self, on_report: Callable[[HealthReport], None]) -> int:
        query_id = next(self._query_ids)
        self._health[query_id] = on_report
        return query_id

    def drop_health_query(self, query_id: int) -> None:
        self._health.pop(query_id, None)

    # ---- from the broker ----

    def dispatch(self, msg: Msg | None, frames: list[Any], now: float) -> list[tuple[Submit, list[Any]]]:
        """One decoded message from the broker and its payload frames. Returns the requests to send again
        (the broker restarted and lost them), usually none."""
        if isinstance(msg, Replies):
            self.last_heard_s = now
            self._replies(msg, frames)
        elif isinstance(msg, Chunks):
            self.last_heard_s = now
            for chunk in msg.items:
                entry = self._entries.get(chunk.req_id)
                if entry is not None:
                    entry.streamed = True
                    entry.waiter.chunk(chunk)
        elif isinstance(msg, HealthReport):
            self.last_heard_s = now
            restarted = self.epoch is not None and msg.epoch != self.epoch
            self.epoch = msg.epoch
            on_report = self._health.pop(msg.query_id, None)
            if on_report is not None:
                on_report(msg)
            if restarted:
                return self.broker_lost(now)
        elif msg is not None:
            log.warning("unexpected %s from the broker", type(msg).__name__)
        return []

    def broker_lost(self, now: float) -> list[tuple[Submit, list[Any]]]:
        """The connection to the broker dropped, or the broker restarted: every pending request is gone
        there (a reconnected socket has a new identity, so even a broker that lived on could not answer it).
        Returns what to resubmit, with what is left of each deadline; fails the rest."""
        self.epoch = None  # the next HealthReport is the new broker's: not a restart
        resend = []
        for req_id, entry in list(self._entries.items()):
            submit = entry.submit
            if entry.streamed:
                del self._entries[req_id]
                entry.waiter.fail(EngineLost("the broker restarted while streaming; the text so far is all there is"))
                continue
            if entry.guard_s is not None:
                left_ms = int((entry.guard_s - DEADLINE_GRACE_S - now) * 1000.0)
                if left_ms <= 0:
                    del self._entries[req_id]
                    entry.waiter.fail(DeadlineExceeded("no answer before the deadline (the broker restarted)"))
                    continue
                submit = msgspec.structs.replace(submit, timeout_ms=left_ms)
            resend.append((submit, entry.frames))
        if resend:
            log.warning("lost the broker at %s: resubmitting %d pending requests", self.endpoint, len(resend))
        return resend

    def _replies(self, msg: Replies, frames: list[Any]) -> None:
        counts = msg.frame_counts
        aligned = len(counts) == len(msg.items) and sum(counts) == len(frames) and min(counts, default=0) >= 0
        offset = 0
        for i, reply in enumerate(msg.items):
            entry = self._entries.pop(reply.req_id, None)
            if not aligned:
                if entry is not None:
                    entry.waiter.fail(ModelError("the broker sent a malformed reply (frame counts do not match)"))
                continue
            count = counts[i]
            if entry is not None:
                entry.waiter.reply(reply, frames[offset : offset + count])
            offset += count

    # ---- time ----

    def expired(self, now: float) -> list[int]:
        """Requests past their local guard: answered DeadlineExceeded here (the caller tells the broker)."""
        late = [req_id for req_id, e in self._entries.items() if e.guard_s is not None and now > e.guard_s]
        for req_id in late:
            self._entries.pop(req_id).waiter.fail(DeadlineExceeded("no answer before the deadline"))
        return late

    def ping_due(self, now: float) -> bool:
        """Whether to ping the broker now (only while requests are pending); fails every pending request if
        the broker has been silent too long."""
        if not self._entries:
            return False
        if now - self.last_heard_s > BROKER_SILENCE_S:
            self.fail_all(BrokerUnavailable(f"the broker at {self.endpoint} stopped answering"))
            return False
        if now - self.last_ping_s >= PING_INTERVAL_S:
            self.last_ping_s = now
            return True
        return False

    def fail_all(self, error: ZserveError) -> None:
        entries, self._entries = self._entries, {}
        for entry in entries.values():
            entry.waiter.fail(type(error)(error.message))

"""The broker's table of accepted requests: who asked, what they sent, and when they must be answered.
Pure: no sockets, no clock. A request leaves the table exactly once, when it is answered."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Request:
    item_id: int  # broker-wide id (clients' req_ids are only unique per client)
    client: bytes  # the client's ROUTER identity
    req_id: int  # the client's own id, echoed in the Reply
    model: str
    frames: list[Any]  # payload frames, forwarded untouched
    decoded: bool
    arrived_s: float
    deadline_s: float
    attempts: int = 0  # dispatches that were lost with their worker
    dispatched_s: float = 0.0
    batch_id: int = 0  # 0 while queued
    stream: bool = False  # generative: the client wants Chunks
    chunks_sent: int = 0  # a streamed request with chunks out cannot be re-dispatched (text would repeat)


class RequestTable:
    def __init__(self) -> None:
        self._by_id: dict[int, Request] = {}
        self._by_client: dict[tuple[bytes, int], int] = {}
        self._deadlines: list[tuple[float, int]] = []  # heap; stale entries skipped lazily
        self._next_id = 1

    def __len__(self) -> int:
        return len(self._by_id)

    def add(
        self, client: bytes, req_id: int, model: str, frames: list[Any], decoded: bool, now: float, deadline_s: float
    ) -> Request:
        item_id = self._next_id
        self._next_id += 1
        request = Request(item_id, client, req_id, model, frames, decoded, now, deadline_s)
        self._by_id[item_id] = request
        self._by_client[(client, req_id)] = item_id
        heapq.heappush(self._deadlines, (deadline_s, item_id))
        return request

    def get(self, item_id: int) -> Request | None:
        return self._by_id.get(item_id)

    def find(self, client: bytes, req_id: int) -> Request | None:
        item_id = self._by_client.get((client, req_id))
        return None if item_id is None else self._by_id.get(item_id)

    def pop(self, item_id: int) -> Request | None:
        request = self._by_id.pop(item_id, None)
        if request is not None:
            self._by_client.pop((request.client, request.req_id), None)
        return request

    def expired(self, now: float) -> list[Request]:
        """Requests whose deadline has passed (still in the table; the caller answers and pops them)."""
        out = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, item_id = heapq.heappop(self._deadlines)
            request = self._by_id.get(item_id)
            if request is not None:
                out.append(request)
        return out

    def next_deadline_s(self) -> float | None:
        while self._deadlines and self._deadlines[0][1] not in self._by_id:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def all(self) -> list[Request]:
        return list(self._by_id.values())

"""The broker's table of accepted requests: who asked, what they sent, and when they must be answered.
Pure: no sockets, no clock. A request leaves the table exactly once, when it is answered.

Hot path: a request is added and popped once each, at a few dict operations apiece. Deadlines are kept in
one FIFO of ids per distinct timeout (requests with the same timeout expire in arrival order), so there is
no heap and no tuple per request; ids of requests answered already are skipped lazily, and a FIFO is
compacted when they outnumber the live ones, so memory stays bounded by the requests pending."""

from __future__ import annotations

from collections import deque
from typing import Any

import msgspec


class Request(msgspec.Struct, gc=False):  # a C-level constructor: this runs once per request
    item_id: int  # broker-wide id (clients' req_ids are only unique per client)
    client: bytes  # the client's ROUTER identity
    req_id: int  # the client's own id, echoed in the Reply
    model: str
    frames: list[Any]  # payload frames, forwarded untouched
    decoded: bool
    arrived_s: float
    deadline_s: float
    stream: bool = False  # generative: the client wants Chunks
    attempts: int = 0  # dispatches that were lost with their worker
    dispatched_s: float = 0.0
    batch_id: int = 0  # 0 while queued
    chunks_sent: int = 0  # a streamed request with chunks out cannot be re-dispatched (text would repeat)
    cost: int = 1  # what the client said it costs (models batched by cost)
    suspect: bool = False  # was in a batch that hung: goes alone, and a worker that stalls on it is hung sooner
    # generative models routed cache_aware: the prompt's blocks (Submit.block_hashes, or block_hashes_packed)
    block_hashes: list[int] | bytes = []
    priority: int = 0  # Submit.priority
    tenant: str = ""  # Submit.tenant: counted in RequestTable.pending_by_tenant while pending


class RequestTable:
    def __init__(self) -> None:
        self.by_id: dict[int, Request] = {}  # read it freely (hot loops do); change it only through here
        self._by_client: dict[bytes, dict[int, Request]] = {}  # client -> its req_id -> request
        self._deadlines: dict[float, deque[int]] = {}  # timeout -> ids in arrival (= deadline) order
        self._next_id = 1
        self.pending_by_tenant: dict[str, int] = {}  # tenant -> its requests in the table (max_concurrent)

    def __len__(self) -> int:
        return len(self.by_id)

    def __bool__(self) -> bool:
        return bool(self.by_id)

    def add(
        self,
        client: bytes,
        req_id: int,
        model: str,
        frames: list[Any],
        decoded: bool,
        now: float,
        timeout_s: float,
        stream: bool = False,
    ) -> Request | None:
        """A new request, due ``timeout_s`` from ``now`` (``now`` never decreases: a monotonic clock); None
        if this client has a request with this id pending already."""
        mine = self._by_client.get(client)
        if mine is None:
            mine = self._by_client[client] = {}
        elif req_id in mine:
            return None
        item_id = self._next_id
        self._next_id += 1
        request = Request(item_id, client, req_id, model, frames, decoded, now, now + timeout_s, stream)
        self.by_id[item_id] = request
        mine[req_id] = request
        fifo = self._deadlines.get(timeout_s)
        if fifo is None:
            fifo = self._deadlines[timeout_s] = deque()
        elif len(fifo) > 4 * len(self.by_id) + 1024:  # mostly answered ids: drop them (amortised O(1))
            fifo = self._deadlines[timeout_s] = deque(i for i in fifo if i in self.by_id)
        fifo.append(item_id)
        return request

    def set_tenant(self, request: Request, tenant: str) -> None:
        """Count ``request`` as ``tenant``'s until it leaves the table (set once, right after ``add``)."""
        request.tenant = tenant
        self.pending_by_tenant[tenant] = self.pending_by_tenant.get(tenant, 0) + 1

    def get(self, item_id: int) -> Request | None:
        return self.by_id.get(item_id)

    def find(self, client: bytes, req_id: int) -> Request | None:
        mine = self._by_client.get(client)
        return None if mine is None else mine.get(req_id)

    def pop(self, item_id: int) -> Request | None:
        request = self.by_id.pop(item_id, None)
        if request is not None:
            mine = self._by_client[request.client]
            del mine[request.req_id]
            if not mine:
                del self._by_client[request.client]
            if request.tenant:
                self.pending_by_tenant[request.tenant] -= 1
        return request

    def expired(self, now: float) -> list[Request]:
        """Requests whose deadline has passed (still in the table; the caller answers and pops them)."""
        out = []
        by_id = self.by_id
        for fifo in self._deadlines.values():
            while fifo:
                request = by_id.get(fifo[0])
                if request is not None and request.deadline_s > now:
                    break
                fifo.popleft()
                if request is not None:
                    out.append(request)
        return out

    def next_deadline_s(self) -> float | None:
        best = None
        by_id = self.by_id
        for timeout, fifo in list(self._deadlines.items()):
            while fifo and fifo[0] not in by_id:
                fifo.popleft()
            if not fifo:
                del self._deadlines[timeout]  # clients may choose any timeout: keep only those in use
                continue
            deadline = by_id[fifo[0]].deadline_s
            if best is None or deadline < best:
                best = deadline
        return best

    def of_client(self, client: bytes) -> list[Request]:
        """Every pending request of one client."""
        return list(self._by_client.get(client, {}).values())

    def all(self) -> list[Request]:
        return list(self.by_id.values())

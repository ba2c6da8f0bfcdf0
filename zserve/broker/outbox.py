"""What the broker core sends, addressed, as it accumulates until ``Outbox.flush`` (``BrokerCore.flush``). Pure."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zserve.broker.requests import Request, RequestTable
from zserve.protocol import Chunk, Chunks, Msg, Replies, Reply, Status


@dataclass(slots=True)
class ClientSend:
    """A message for the client ROUTER: ``header`` (to encode) and payload ``frames``, for ``identity``."""

    identity: bytes
    header: Msg
    frames: list[Any] = field(default_factory=list)


@dataclass(slots=True)
class WorkSend:
    """A message for the work ROUTER. ``batch_id`` is the Batch it carries (0 for control messages), so
    that the shell can say which batches never reached a worker it could not send to."""

    worker_id: bytes
    header: Msg
    frames: list[Any] = field(default_factory=list)
    batch_id: int = 0


class ClientOut:
    """What one client gets at the next flush."""

    __slots__ = ("chunks", "counts", "frames", "replies")

    def __init__(self) -> None:
        self.chunks: list[Chunk] = []
        self.replies: list[Reply] = []
        self.counts: list[int] = []
        self.frames: list[Any] = []


class Outbox:
    """Everything the core has to send, addressed, until ``flush``: per client its chunks and replies (each
    request's one answer leaves through ``reply``, which also takes it out of the request table), other
    client messages (health reports), and the work messages in the order they arose."""

    def __init__(self, requests: RequestTable) -> None:
        self.requests = requests
        # client identity -> what it gets at the next flush; hot loops may read it (``client`` adds to it)
        self.clients: dict[bytes, ClientOut] = {}
        self._client_misc: list[ClientSend] = []
        self._work: list[WorkSend] = []

    def flush(self) -> tuple[list[ClientSend], list[WorkSend]]:
        """Everything to send since the last flush: per client at most one Chunks then one Replies (then
        health reports), and the work messages in the order they arose."""
        clients: list[ClientSend] = []
        for identity, out in self.clients.items():
            if out.chunks:
                clients.append(ClientSend(identity, Chunks(out.chunks)))
            if out.replies:
                clients.append(ClientSend(identity, Replies(out.replies, out.counts), out.frames))
        clients += self._client_misc
        work = self._work
        self.clients, self._client_misc, self._work = {}, [], []
        return clients, work

    def client(self, identity: bytes) -> ClientOut:
        """What ``identity`` gets at the next flush, to add to."""
        out = self.clients.get(identity)
        if out is None:
            out = self.clients[identity] = ClientOut()
        return out

    def answer(self, identity: bytes, reply: Reply, frames: list[Any] | tuple[()] = ()) -> None:
        """A Reply to a client, for a request that is not (or no longer) in the table."""
        out = self.client(identity)
        out.replies.append(reply)
        out.counts.append(len(frames))
        out.frames.extend(frames)

    def reply(
        self, request: Request, status: Status, message: str = "", frames: list[Any] | tuple[()] = (), **fields: Any
    ) -> None:
        """The request's one answer (``fields``: the rest of Reply), and its removal from the table."""
        self.requests.pop(request.item_id)
        self.answer(request.client, Reply(request.req_id, status, message, **fields), frames)

    def chunk(self, identity: bytes, chunk: Chunk) -> None:
        """Streamed text; it leaves before the client's Replies of the same flush."""
        self.client(identity).chunks.append(chunk)

    def to_client(self, identity: bytes, header: Msg) -> None:
        """A message other than Chunks and Replies (a health report), after those of the same flush."""
        self._client_misc.append(ClientSend(identity, header))

    def to_worker(self, worker_id: bytes, header: Msg, frames: list[Any] | None = None, batch_id: int = 0) -> None:
        self._work.append(WorkSend(worker_id, header, frames or [], batch_id))

"""What the broker core sends, addressed, as it accumulates until ``BrokerCore.flush``. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zserve.protocol import Chunk, Msg, Reply


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

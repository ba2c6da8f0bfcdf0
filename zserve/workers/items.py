"""Per-item bookkeeping shared by every worker role: decoding a Batch's items, and turning per-item
outcomes into a BatchResult. An item that fails fails alone."""

from __future__ import annotations

from typing import Any

from zserve import payload
from zserve.errors import ZserveError
from zserve.model import Model
from zserve.protocol import Batch, BatchResult, Status


class Failure:
    """One item's failure: a status and what to tell the client."""

    __slots__ = ("field", "message", "status")

    def __init__(self, status: Status, message: str, field: str = "") -> None:
        self.status = status
        self.message = message
        self.field = field

    @classmethod
    def from_exception(cls, exc: BaseException, default: Status, where: str) -> Failure:
        if isinstance(exc, ZserveError):
            return cls(exc.status, exc.message or str(exc), exc.field)
        return cls(default, f"{where} raised {type(exc).__name__}: {exc}")


def decode_items(model: Model, batch: Batch, frames: list[Any]) -> tuple[list[Any], list[int], list[Any]]:
    """(values, their positions in the batch, per-position outcome so far: None or a Failure). Items the
    frontend did not decode (direct clients) go through ``decode_request`` here."""
    outcomes: list[Any] = [None] * len(batch.item_ids)
    values: list[Any] = []
    positions: list[int] = []
    offset = 0
    for i, (count, decoded) in enumerate(zip(batch.frame_counts, batch.decoded, strict=True)):
        item_frames = frames[offset : offset + count]
        offset += count
        try:
            value = payload.decode(item_frames)
            if not decoded:
                value = model.decode_request(value)
        except Exception as exc:
            outcomes[i] = Failure.from_exception(exc, Status.BAD_REQUEST, "decode_request")
            continue
        values.append(value)
        positions.append(i)
    return values, positions, outcomes


class ResultBuilder:
    """Collects per-item outcomes, in batch order, into a BatchResult and its frames."""

    def __init__(self) -> None:
        self.statuses: list[Status] = []
        self.messages: list[str] = []
        self.fields: list[str] = []
        self.counts: list[int] = []
        self.frames: list[Any] = []

    def ok(self, frames: list[Any]) -> None:
        self.statuses.append(Status.OK)
        self.messages.append("")
        self.fields.append("")
        self.counts.append(len(frames))
        self.frames.extend(frames)

    def failed(self, failure: Failure) -> None:
        self.statuses.append(failure.status)
        self.messages.append(failure.message)
        self.fields.append(failure.field)
        self.counts.append(0)

    def build(self, batch_id: int, worker_id: str, compute_ms: float, tail: list[Any] | None = None):
        """The header and frames; ``tail`` (a stage's prepared payload) goes after every item's frames."""
        tail = tail or []
        header = BatchResult(
            batch_id, worker_id, self.statuses, self.messages, self.fields, self.counts, compute_ms, len(tail)
        )
        return header, self.frames + tail

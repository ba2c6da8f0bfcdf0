"""The Batch message (and its payload frames) that carries a batch the scheduler formed to its worker. Pure."""

from __future__ import annotations

from typing import Any

from zserve.batching.scheduler import Dispatch
from zserve.broker.requests import RequestTable
from zserve.protocol import Batch


def batch_message(
    d: Dispatch, requests: RequestTable, generative: frozenset[str], now: float
) -> tuple[Batch, list[Any]]:
    # Aligned with d.item_ids (results are matched by position). An item answered meanwhile cannot be
    # here, but if it were it would travel without payload and fail alone.
    get = requests.by_id.get
    frames: list[Any] = []
    counts: list[int] = []
    decoded: list[bool] = []
    streams: list[bool] = []
    priorities: list[int] = []
    batch_id = d.batch_id
    for item_id in d.item_ids:
        r = get(item_id)
        if r is None:
            counts.append(0)
            decoded.append(True)
            streams.append(False)
            priorities.append(0)
            continue
        r.batch_id = batch_id
        r.dispatched_s = now
        frames += r.frames
        counts.append(len(r.frames))
        decoded.append(r.decoded)
        streams.append(r.stream)
        priorities.append(r.priority)
    is_generative = d.model in generative
    stream = streams if is_generative else []
    # a generative engine orders its sequences by priority too; all 0 (the common case) travels as nothing
    ranks = priorities if is_generative and any(priorities) else []
    batch = Batch(batch_id, d.model, d.item_ids, counts, decoded, stream=stream, preprocess=d.preprocess,
                  priorities=ranks)  # fmt: skip
    return batch, frames


def prepared_batch_message(d: Dispatch, requests: RequestTable) -> tuple[Batch, list[Any]]:
    decoded = []
    for item_id in d.item_ids:
        request = requests.get(item_id)
        if request is not None:  # answered meanwhile (deadline, cancel): computed, its result dropped
            request.batch_id = d.batch_id
        decoded.append(request.decoded if request is not None else True)
    frames = d.prepared.frames
    return Batch(d.batch_id, d.model, d.item_ids, [len(frames)], decoded, prepared=True), list(frames)

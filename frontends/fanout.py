"""One HTTP request, several broker requests (the prompts and choices of a completion, the inputs of an
embeddings call, the pairs of a rerank): awaited together, and cancelled together. A piece refused (503
overloaded, 429), failed, past its deadline, or a caller gone (the route's task cancelled) cancels every other
piece in the broker at once, so no work runs on for an answer nobody reads."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


async def gather_or_cancel(awaitables: list[Awaitable[T]]) -> list[T]:
    """Every result in order, or the first error with the other pieces cancelled (a cancelled ``infer``
    cancels its request in the broker; a stream's consumer closes its stream)."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
            # the others' errors (often the same 503) are answered by the first: retrieved, so none is logged as
            # "never retrieved"
            task.add_done_callback(_retrieve)
        raise


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()

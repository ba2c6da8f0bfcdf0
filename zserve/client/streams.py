"""Streams of generated text: ``GenerationStream`` (iterate) for ``Client.generate_stream`` and
``AsyncGenerationStream`` (``async for``) for ``AsyncClient.generate_stream``. Leaving the loop early,
``close()`` or ``aclose()`` cancels the request: the engine frees its KV blocks at once."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import msgspec

from zserve.client.pending import Answer, answer_of
from zserve.errors import ModelError, ZserveError
from zserve.generation import GenerateResponse
from zserve.protocol import Chunk, Reply, TokenLogprob

END = object()  # a sync stream's last item: the reply is in its future


def prompt_body(prompt: Any, sampling: dict[str, Any]) -> Any:
    """A prompt (text), or chat messages (a list of {"role", "content"}), with sampling options."""
    key = "messages" if isinstance(prompt, list) else "prompt"
    return {key: prompt, **sampling}


def response_of(model: str, value: Any) -> GenerateResponse:
    try:
        return msgspec.convert(value, GenerateResponse)
    except msgspec.ValidationError as exc:
        raise ModelError(f"model {model!r} did not answer like a generative model: {exc}") from None


class GenerationStream:
    """Text deltas of one generation, as they are produced; ``response`` once it is exhausted."""

    def __init__(
        self,
        model: str,
        future: concurrent.futures.Future,
        chunks: queue.SimpleQueue,
        cancel: Callable[[], None],
    ) -> None:
        self._model = model
        self._future = future
        self._cancel = cancel
        self.chunks = chunks  # Chunks, then END (filled by the client's IO thread)
        self.response: GenerateResponse | None = None
        # the logprobs of the tokens of the delta last returned, when the request asked for logprobs
        self.delta_logprobs: list[TokenLogprob] = []

    def __iter__(self) -> Iterator[str]:
        # a generator, so that leaving a ``for`` loop early (break, an exception) cancels at once
        try:
            while True:
                try:
                    yield next(self)
                except StopIteration:
                    return
        finally:
            self.close()

    def __next__(self) -> str:
        if self.response is not None:
            raise StopIteration
        item = self.chunks.get()
        if item is END:
            self.response = response_of(self._model, self._future.result())
            raise StopIteration
        self.delta_logprobs = item.logprobs
        return item.text

    def close(self) -> None:
        """Stop early: the request is cancelled and the engine frees its blocks."""
        if not self._future.done():
            self._cancel()

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class AsyncGenerationStream:
    """``async for delta in stream``: text deltas of one generation; ``response`` once it is exhausted.
    Leaving the loop early (or ``await stream.aclose()``) cancels the request. It is its own waiter in the
    client's pending table: the table feeds ``chunk``/``reply``/``fail`` into one queue."""

    def __init__(self, model: str, start: Callable[[AsyncGenerationStream], int], cancel: Callable[[int], None]):
        self._model = model
        self._start = start
        self._cancel = cancel
        self._req_id: int | None = None
        self._items: asyncio.Queue = asyncio.Queue()
        self._done = False
        self.response: GenerateResponse | None = None
        self.answer: Answer | None = None  # the Reply's, with serving metadata
        # the logprobs of the tokens of the delta last returned, when the request asked for logprobs
        self.delta_logprobs: list[TokenLogprob] = []

    # ---- the waiter side (called by the pending table) ----

    def chunk(self, chunk: Chunk) -> None:
        self._items.put_nowait(chunk)

    def reply(self, reply: Reply, frames: list[Any]) -> None:
        self._items.put_nowait((reply, frames))

    def fail(self, error: ZserveError) -> None:
        self._items.put_nowait(error)

    # ---- the caller's side ----

    def __aiter__(self) -> AsyncIterator[str]:
        return self

    async def __anext__(self) -> str:
        if self._done:
            raise StopAsyncIteration
        if self._req_id is None:
            self._req_id = self._start(self)
        try:
            item = await self._items.get()
        except asyncio.CancelledError:
            await self.aclose()
            raise
        if isinstance(item, Chunk):
            self.delta_logprobs = item.logprobs
            return item.text
        self._done = True
        if isinstance(item, ZserveError):
            raise item
        reply, frames = item
        self.answer = answer_of(reply, frames)
        self.response = response_of(self._model, self.answer.value)
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Stop early: the request is cancelled and the engine frees its blocks."""
        if self._req_id is not None and not self._done:
            self._done = True
            self._cancel(self._req_id)

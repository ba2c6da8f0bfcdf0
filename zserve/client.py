"""Direct Python clients: straight to the broker over ZeroMQ, no HTTP.

* ``Client``: thread-safe; ``predict`` blocks, ``submit`` returns a ``concurrent.futures.Future`` (many in
  flight from one thread). One I/O thread owns the socket.
* ``AsyncClient``: ``await predict(...)`` from asyncio; the frontends use it too.

Generative models: ``generate(prompts, model=..., **sampling)`` returns one ``GenerateResponse`` per prompt
(all prompts in flight at once, so the engine batches them); ``generate_stream(prompt, model=...)`` yields
text deltas as the engine produces them, and holds the whole response in ``.response`` at the end. Closing
a stream early (``break``, ``close()``) cancels the request: the engine frees its KV blocks at once.

Payloads sent here are raw request bodies: the engine runs the model's ``decode_request`` and
``encode_response`` hooks, so ``client.predict("embed", {"text": "hi"})`` answers exactly what
``POST /v1/models/embed/predict`` would. Errors arrive as the typed exceptions of ``zserve.errors``.

While requests are pending, a client pings the broker; if the broker stops answering, or restarts (its
epoch changes), every pending request fails with ``BrokerUnavailable``/``EngineLost`` instead of hanging.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import queue
import random
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from zserve import payload
from zserve.config import endpoints_for, load_config, run_dir_for
from zserve.errors import (
    BrokerUnavailable,
    Cancelled,
    DeadlineExceeded,
    EngineLost,
    ModelError,
    ZserveError,
    error_for,
)
from zserve.generation import GenerateResponse
from zserve.protocol import Cancel, Chunk, Codec, HealthQuery, HealthReport, Reply, Status, Submit
from zserve.transport import make_socket

PING_INTERVAL_S = 1.0
BROKER_SILENCE_S = 5.0  # pending requests fail after this long without a word from the broker
_DEADLINE_GRACE_S = 1.0  # the broker answers DEADLINE_EXCEEDED itself; this only guards against its loss
_END = object()  # a stream's last item: the reply is in its future


def _prompt_body(prompt: Any, sampling: dict[str, Any]) -> Any:
    """A prompt (text), or chat messages (a list of {"role", "content"}), with sampling options."""
    key = "messages" if isinstance(prompt, list) else "prompt"
    return {key: prompt, **sampling}


def _response(model: str, value: Any) -> GenerateResponse:
    try:
        return msgspec.convert(value, GenerateResponse)
    except msgspec.ValidationError as exc:
        raise ModelError(f"model {model!r} did not answer like a generative model: {exc}") from None


class GenerationStream:
    """Text deltas of one generation, as they are produced; ``response`` once it is exhausted."""

    def __init__(
        self, client: Client, model: str, req_id: int, future: concurrent.futures.Future, chunks: queue.SimpleQueue
    ) -> None:
        self._client = client
        self._model = model
        self._req_id = req_id
        self._future = future
        self.chunks = chunks  # text deltas, then _END (filled by the client's IO thread)
        self.response: GenerateResponse | None = None

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
        if item is _END:
            self.response = _response(self._model, self._future.result())
            raise StopIteration
        return item

    def close(self) -> None:
        """Stop early: the request is cancelled and the engine frees its blocks."""
        if not self._future.done() and not self._client._closed:
            self._client._post(("cancel", self._req_id))

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if not self._future.done() and not self._client._closed:
            self.close()


@dataclass(slots=True)
class Answer:
    """A successful reply with its serving metadata."""

    value: Any
    batch_size: int
    queue_ms: float
    compute_ms: float


def endpoint_from_config(path: str | os.PathLike[str]) -> str:
    """The broker's client endpoint for the deployment described by ``path`` (a supervisor.toml)."""
    config = load_config(path)
    return endpoints_for(config, run_dir_for(config, path)).client


def _answer(reply: Reply, frames: list[Any]) -> Answer:
    if reply.status != Status.OK:
        raise error_for(Status(reply.status), reply.message, reply.field)
    return Answer(payload.decode(frames), reply.batch_size, reply.queue_ms, reply.compute_ms)


class _Pending:
    """Bookkeeping shared by both clients: ids, pings, and failing everything when the broker is lost."""

    def __init__(self) -> None:
        self.ids = itertools.count(random.getrandbits(20) << 32)
        self.epoch: int | None = None
        self.last_heard_s = time.monotonic()
        self.last_ping_s = 0.0

    def heard(self, report: HealthReport | None = None) -> bool:
        """Note a message from the broker; True if it reveals a broker restart."""
        self.last_heard_s = time.monotonic()
        if report is None:
            return False
        restarted = self.epoch is not None and report.epoch != self.epoch
        self.epoch = report.epoch
        return restarted

    def ping_due(self, now: float) -> bool:
        if now - self.last_ping_s >= PING_INTERVAL_S:
            self.last_ping_s = now
            return True
        return False

    def silent(self, now: float) -> bool:
        return now - self.last_heard_s > BROKER_SILENCE_S


class Client:
    """A thread-safe, blocking/futures client. ``Client(endpoint)`` or ``Client.from_config(path)``."""

    def __init__(self, endpoint: str, *, timeout_ms: int | None = None) -> None:
        self.endpoint = endpoint
        self.timeout_ms = timeout_ms
        self._ctx = zmq.Context()
        self._outbox: list[tuple[Any, ...]] = []
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)  # a full pipe means a wake-up is pending already
        self._futures: dict[int, tuple[concurrent.futures.Future, float | None, bool]] = {}
        self._streams: dict[int, queue.SimpleQueue] = {}  # streamed requests' chunk queues (IO thread only)
        self._state = _Pending()
        self._closed = False
        self._thread = threading.Thread(target=self._io_loop, name="zserve-client-io", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, path: str | os.PathLike[str], **kwargs: Any) -> Client:
        return cls(endpoint_from_config(path), **kwargs)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- public API ----

    def submit(self, model: str, body: Any, *, timeout_ms: int | None = None) -> concurrent.futures.Future:
        """Send one request; the Future resolves to the response (or raises a ``ZserveError``)."""
        return self._submit(model, body, timeout_ms, with_meta=False)

    def predict(self, model: str, body: Any, *, timeout_ms: int | None = None) -> Any:
        return self.submit(model, body, timeout_ms=timeout_ms).result()

    def infer(self, model: str, body: Any, *, timeout_ms: int | None = None) -> Answer:
        """Like ``predict``, with the batch size and queue time the request saw."""
        return self._submit(model, body, timeout_ms, with_meta=True).result()

    def generate(
        self, prompts: str | list[str], *, model: str, timeout_ms: int | None = None, **sampling: Any
    ) -> list[GenerateResponse]:
        """One response per prompt from a generative model (``CausalLM``). ``sampling``: ``max_new_tokens``,
        ``min_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``, ``stop_token_ids``,
        ``ignore_eos``. The prompts are in flight together, so the engine runs them together."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        futures = [self.submit(model, {"prompt": p, **sampling}, timeout_ms=timeout_ms) for p in prompts]
        return [_response(model, f.result()) for f in futures]

    def generate_stream(
        self, prompt: str | list[dict[str, str]], *, model: str, timeout_ms: int | None = None, **sampling: Any
    ) -> GenerationStream:
        """Iterate over the text as it is generated; ``.response`` holds the whole response at the end.
        ``prompt`` is a text, or chat messages ``[{"role": "user", "content": "..."}]``."""
        req_id, chunks = next(self._state.ids), queue.SimpleQueue()
        future = self._submit(model, _prompt_body(prompt, sampling), timeout_ms, False, req_id, chunks)
        return GenerationStream(self, model, req_id, future, chunks)

    def health(self, timeout_s: float = 5.0) -> HealthReport:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._post(("health", future))
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise BrokerUnavailable(f"no answer from the broker at {self.endpoint} in {timeout_s}s") from None

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._outbox.append(("close",))
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already
        self._thread.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ---- internals ----

    def _submit(
        self,
        model: str,
        body: Any,
        timeout_ms: int | None,
        with_meta: bool,
        req_id: int | None = None,
        chunks: queue.SimpleQueue | None = None,
    ) -> concurrent.futures.Future:
        """Queue a Submit for the IO thread; ``chunks`` (a stream's queue) asks for Chunks as well."""
        frames = payload.encode(body)
        timeout_ms = timeout_ms if timeout_ms is not None else self.timeout_ms
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._post(("submit", future, model, frames, timeout_ms or 0, with_meta, req_id, chunks))
        return future

    def _post(self, item: tuple[Any, ...]) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("client is closed")
            self._outbox.append(item)
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

    def _io_loop(self) -> None:
        codec = Codec()
        sock = make_socket(self._ctx, zmq.DEALER, self.endpoint, bind=False)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        health_waiters: dict[int, concurrent.futures.Future] = {}
        query_ids = itertools.count(1)
        state = self._state
        try:
            while True:
                events = dict(poller.poll(int(PING_INTERVAL_S * 1000)))
                if self._wake_r in events:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                    with self._lock:
                        outbox, self._outbox = self._outbox, []
                    for item in outbox:
                        if item[0] == "close":
                            return
                        if item[0] == "cancel":
                            self._cancel(sock, codec, item[1])
                            continue
                        if item[0] == "health":
                            qid = next(query_ids)
                            health_waiters[qid] = item[1]
                            sock.send(codec.encode(HealthQuery(qid)))
                        else:
                            self._send_submit(sock, codec, *item[1:])
                if sock in events:
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        msg = codec.decode(frames[0].buffer, "broker")
                        if isinstance(msg, Reply):
                            state.heard()
                            self._resolve(msg, frames[1:])
                        elif isinstance(msg, Chunk):
                            state.heard()
                            chunks = self._streams.get(msg.req_id)
                            if chunks is not None:
                                chunks.put(msg.text)
                        elif isinstance(msg, HealthReport):
                            if state.heard(msg):
                                self._fail_all(EngineLost("the broker restarted; the request was lost"))
                            waiter = health_waiters.pop(msg.query_id, None)
                            if waiter is not None and not waiter.done():
                                waiter.set_result(msg)
                self._housekeeping(sock, codec)
        finally:
            self._fail_all(BrokerUnavailable("the client was closed"))
            with self._lock:
                leftover, self._outbox = self._outbox, []
            for item in leftover:  # posted just before close: answer them too
                if item[0] not in ("close", "cancel") and not item[1].done():
                    item[1].set_exception(BrokerUnavailable("the client was closed"))
                if item[0] == "submit" and item[7] is not None:
                    item[7].put(_END)  # a stream that never left: end it too
            for waiter in health_waiters.values():
                if not waiter.done():
                    waiter.set_exception(BrokerUnavailable("the client was closed"))
            sock.close(linger=0)
            self._ctx.term()

    def _send_submit(
        self,
        sock: zmq.Socket,
        codec: Codec,
        future: Any,
        model: str,
        frames: list[Any],
        timeout_ms: int,
        with_meta: bool,
        req_id: int | None,
        chunks: queue.SimpleQueue | None,
    ) -> None:
        if not future.set_running_or_notify_cancel():
            return
        if req_id is None:
            req_id = next(self._state.ids)
        if chunks is not None:
            self._streams[req_id] = chunks
        if not self._futures:
            self._state.last_heard_s = time.monotonic()  # silence is measured from the first pending request
        guard = time.monotonic() + timeout_ms / 1000.0 + _DEADLINE_GRACE_S if timeout_ms else None
        self._futures[req_id] = (future, guard, with_meta)
        submit = Submit(req_id, model, timeout_ms, False, stream=chunks is not None)
        sock.send_multipart([codec.encode(submit), *frames], copy=False)

    def _cancel(self, sock: zmq.Socket, codec: Codec, req_id: int) -> None:
        entry = self._futures.pop(req_id, None)
        if entry is None:
            return
        sock.send(codec.encode(Cancel(req_id)))
        self._end_stream(req_id)
        if not entry[0].done():
            entry[0].set_exception(Cancelled("cancelled by the caller"))

    def _end_stream(self, req_id: int) -> None:
        chunks = self._streams.pop(req_id, None)
        if chunks is not None:
            chunks.put(_END)

    def _resolve(self, reply: Reply, frames: list[Any]) -> None:
        entry = self._futures.pop(reply.req_id, None)
        self._end_stream(reply.req_id)
        if entry is None:
            return  # answered already (local deadline), or cancelled
        future, _, with_meta = entry
        try:
            answer = _answer(reply, frames)
        except Exception as exc:  # a ZserveError, or a payload that does not decode: never kill the IO thread
            future.set_exception(exc)
        else:
            future.set_result(answer if with_meta else answer.value)

    def _fail_all(self, exc: ZserveError) -> None:
        futures, self._futures = self._futures, {}
        for future, _, _ in futures.values():
            if not future.done():
                future.set_exception(type(exc)(exc.message))
        for req_id in list(self._streams):
            self._end_stream(req_id)

    def _housekeeping(self, sock: zmq.Socket, codec: Codec) -> None:
        if not self._futures:
            return
        now = time.monotonic()
        for req_id, (future, guard, _) in list(self._futures.items()):
            if guard is not None and now > guard:
                del self._futures[req_id]
                sock.send(codec.encode(Cancel(req_id)))
                future.set_exception(DeadlineExceeded("no answer before the deadline"))
                self._end_stream(req_id)
        if self._state.silent(now):
            self._fail_all(BrokerUnavailable(f"the broker at {self.endpoint} stopped answering"))
        elif self._state.ping_due(now):
            sock.send(codec.encode(HealthQuery(0)))


class AsyncGenerationStream:
    """``async for delta in stream``: text deltas of one generation; ``response`` once it is exhausted.
    Leaving the loop early (or ``await stream.aclose()``) cancels the request."""

    def __init__(self, client: AsyncClient, model: str, frames: list[Any], timeout_ms: int, decoded: bool) -> None:
        self._client = client
        self._model = model
        self._frames = frames
        self._timeout_ms = timeout_ms
        self._decoded = decoded
        self._req_id: int | None = None
        self._chunks: asyncio.Queue = asyncio.Queue()
        self._deadline: float | None = None
        self.response: GenerateResponse | None = None
        self.answer: Answer | None = None  # the Reply's, with serving metadata

    def __aiter__(self) -> AsyncIterator[str]:
        return self

    async def __anext__(self) -> str:
        if self.answer is not None:
            raise StopAsyncIteration
        client = self._client
        if self._req_id is None:
            await client._start_stream(self._model, self._frames, self._timeout_ms, self._decoded, self)
            if self._timeout_ms:
                self._deadline = time.monotonic() + self._timeout_ms / 1000.0 + _DEADLINE_GRACE_S
        try:
            if self._deadline is None:
                item = await self._chunks.get()
            else:
                item = await asyncio.wait_for(self._chunks.get(), max(0.0, self._deadline - time.monotonic()))
        except asyncio.TimeoutError:
            await self.aclose()
            raise DeadlineExceeded("no answer before the deadline") from None
        except asyncio.CancelledError:
            await self.aclose()
            raise
        if isinstance(item, Chunk):
            return item.text
        client._streams.pop(self._req_id, None)
        if isinstance(item, ZserveError):
            raise item
        reply, frames = item
        self.answer = _answer(reply, frames)
        self.response = _response(self._model, self.answer.value)
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Stop early: the request is cancelled and the engine frees its blocks."""
        if self._req_id is not None and self.answer is None and self._client._streams.pop(self._req_id, None):
            await self._client._cancel(self._req_id)

    def _put(self, item: Any) -> None:
        self._chunks.put_nowait(item)


class AsyncClient:
    """An asyncio client; create and use it inside one running event loop."""

    def __init__(self, endpoint: str, *, timeout_ms: int | None = None) -> None:
        self.endpoint = endpoint
        self.timeout_ms = timeout_ms
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._codec = Codec()
        self._state = _Pending()
        self._futures: dict[int, asyncio.Future] = {}
        self._health: dict[int, asyncio.Future] = {}
        self._streams: dict[int, AsyncGenerationStream] = {}
        self._query_ids = itertools.count(1)
        self._tasks: list[asyncio.Task] = []

    @classmethod
    def from_config(cls, path: str | os.PathLike[str], **kwargs: Any) -> AsyncClient:
        return cls(endpoint_from_config(path), **kwargs)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def _socket(self) -> zmq.asyncio.Socket:
        if self._sock is None:
            self._ctx = zmq.asyncio.Context()
            self._sock = make_socket(self._ctx, zmq.DEALER, self.endpoint, bind=False)
            self._tasks = [asyncio.create_task(self._reader()), asyncio.create_task(self._watchdog())]
        return self._sock

    async def predict(self, model: str, body: Any, *, timeout_ms: int | None = None) -> Any:
        return (await self.infer(model, body, timeout_ms=timeout_ms, decoded=False)).value

    async def infer(self, model: str, body: Any, *, timeout_ms: int | None = None, decoded: bool = False) -> Answer:
        """Send one request and await its Answer. ``decoded=True`` means ``body`` is already the output of
        ``decode_request`` (the frontends run it), so the engine runs only ``predict`` and the Answer holds
        the raw output. Cancelling the awaiting task cancels the request in the broker."""
        self._socket()  # created lazily, inside the running loop
        frames = payload.encode(body)
        timeout_ms = timeout_ms if timeout_ms is not None else self.timeout_ms
        req_id = next(self._state.ids)
        future = asyncio.get_running_loop().create_future()
        if not self._futures:
            self._state.last_heard_s = time.monotonic()
        self._futures[req_id] = future
        try:
            await self._send([self._codec.encode(Submit(req_id, model, timeout_ms or 0, decoded)), *frames])
            if timeout_ms:
                reply, reply_frames = await asyncio.wait_for(future, timeout_ms / 1000.0 + _DEADLINE_GRACE_S)
            else:
                reply, reply_frames = await future
        except asyncio.TimeoutError:
            await self._send([self._codec.encode(Cancel(req_id))])
            raise DeadlineExceeded("no answer before the deadline") from None
        except asyncio.CancelledError:
            if self._sock is not None and not self._sock.closed:
                # best effort: we are being cancelled, so the send is not awaited
                self._sock.send(self._codec.encode(Cancel(req_id)), zmq.NOBLOCK)
            raise
        finally:
            self._futures.pop(req_id, None)
        return _answer(reply, reply_frames)

    async def generate(
        self, prompts: str | list[str], *, model: str, timeout_ms: int | None = None, **sampling: Any
    ) -> list[GenerateResponse]:
        """One response per prompt from a generative model, all in flight together (see ``Client.generate``)."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        values = await asyncio.gather(
            *(self.predict(model, {"prompt": p, **sampling}, timeout_ms=timeout_ms) for p in prompts)
        )
        return [_response(model, v) for v in values]

    def generate_stream(
        self,
        prompt: str | list[dict[str, str]] | dict[str, Any],
        *,
        model: str,
        timeout_ms: int | None = None,
        decoded: bool = False,
        **sampling: Any,
    ) -> AsyncGenerationStream:
        """``async for delta in client.generate_stream("...", model="lm")``; ``prompt`` is a text, chat
        messages, or (with ``decoded=True``, as the frontends do) a body ``decode_request`` already made."""
        body = prompt if isinstance(prompt, dict) else _prompt_body(prompt, sampling)
        timeout_ms = timeout_ms if timeout_ms is not None else self.timeout_ms
        return AsyncGenerationStream(self, model, payload.encode(body), timeout_ms or 0, decoded)

    async def _start_stream(
        self, model: str, frames: list[Any], timeout_ms: int, decoded: bool, stream: AsyncGenerationStream
    ) -> None:
        self._socket()
        req_id = stream._req_id = next(self._state.ids)  # set first: a cancel during the send must find it
        if not self._futures and not self._streams:
            self._state.last_heard_s = time.monotonic()
        self._streams[req_id] = stream
        await self._send([self._codec.encode(Submit(req_id, model, timeout_ms, decoded, stream=True)), *frames])

    async def _cancel(self, req_id: int) -> None:
        if self._sock is not None and not self._sock.closed:
            await self._send([self._codec.encode(Cancel(req_id))])

    async def _send(self, frames: list[Any]) -> None:
        """Send without a future per message: zmq.asyncio's awaitable send costs more than the HTTP request
        it serves. The base class's send is the same libzmq call; only when the pipe is full (far past
        the HWM in practice) do we fall back to awaiting."""
        sock = self._socket()
        try:
            for frame in frames[:-1]:
                zmq.Socket.send(sock, frame, zmq.SNDMORE | zmq.NOBLOCK, copy=False)
            zmq.Socket.send(sock, frames[-1], zmq.NOBLOCK, copy=False)
        except zmq.Again:
            await sock.send_multipart(frames, copy=False)
        # ZMQ's FD is edge-triggered and any call on the socket may consume the edge that announced replies:
        # read them now, or they would wait for the next edge (zmq.asyncio does the same internally).
        self._drain()

    def _drain(self) -> None:
        """Read every message already queued, with plain non-blocking receives (no future per message)."""
        sock = self._sock
        while sock is not None and zmq.Socket.get(sock, zmq.EVENTS) & zmq.POLLIN:
            frames = [zmq.Socket.recv(sock, zmq.NOBLOCK, copy=False)]
            while frames[-1].more:
                frames.append(zmq.Socket.recv(sock, zmq.NOBLOCK, copy=False))
            self._on_message(frames)

    async def health(self, timeout_s: float = 5.0) -> HealthReport:

        qid = next(self._query_ids)
        future = asyncio.get_running_loop().create_future()
        self._health[qid] = future
        await self._send([self._codec.encode(HealthQuery(qid))])
        try:
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            raise BrokerUnavailable(f"no answer from the broker at {self.endpoint} in {timeout_s}s") from None
        finally:
            self._health.pop(qid, None)

    async def _reader(self) -> None:
        while True:
            # One awaited wake-up per burst of replies, then a plain drain: under load one wake-up resolves
            # many requests.
            await self._sock.poll(None, zmq.POLLIN)
            self._drain()

    def _on_message(self, frames: list[Any]) -> None:
        msg = self._codec.decode(frames[0].buffer, "broker")
        if isinstance(msg, Reply):
            self._state.heard()
            stream = self._streams.get(msg.req_id)
            if stream is not None:
                stream._put((msg, frames[1:]))
            future = self._futures.get(msg.req_id)
            if future is not None and not future.done():
                future.set_result((msg, frames[1:]))
        elif isinstance(msg, Chunk):
            self._state.heard()
            stream = self._streams.get(msg.req_id)
            if stream is not None:
                stream._put(msg)
        elif isinstance(msg, HealthReport):
            if self._state.heard(msg):
                self._fail_all(EngineLost("the broker restarted; the request was lost"))
            waiter = self._health.get(msg.query_id)
            if waiter is not None and not waiter.done():
                waiter.set_result(msg)

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(PING_INTERVAL_S)
            if not self._futures and not self._streams:
                continue
            now = time.monotonic()
            if self._state.silent(now):
                self._fail_all(BrokerUnavailable(f"the broker at {self.endpoint} stopped answering"))
            elif self._state.ping_due(now):
                await self._send([self._codec.encode(HealthQuery(0))])

    def _fail_all(self, exc: ZserveError) -> None:
        for future in self._futures.values():
            if not future.done():
                future.set_exception(type(exc)(exc.message))
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream._put(type(exc)(exc.message))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._fail_all(BrokerUnavailable("the client was closed"))
        if self._sock is not None:
            self._sock.close(linger=0)
            self._ctx.term()
            self._sock = None

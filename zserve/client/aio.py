"""``AsyncClient``: ``await predict(...)`` from asyncio; every frontend worker holds one. All requests made
in one event-loop turn leave as one Submits message, sent by a callback at the start of the next turn, so
a frontend under load sends the broker one message per turn, not one per HTTP request."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from zserve import payload
from zserve.batching.prefix_hash import pack
from zserve.client.pending import PING_INTERVAL_S, Answer, PendingTable, Waiter, answer_of
from zserve.client.streams import AsyncGenerationStream, prompt_body, response_of
from zserve.client.sync import _AUTH_FAILED, endpoint_from_config, submits_messages
from zserve.errors import BrokerUnavailable, ZserveError
from zserve.frames import received
from zserve.generation import GenerateRequest, GenerateResponse
from zserve.keys import AuthenticationFailed, CurveKeys
from zserve.protocol import Cancel, Chunk, Codec, HealthQuery, HealthReport, Reply, Submit
from zserve.transport import make_socket

T = TypeVar("T")

_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)  # plain ints: combining zmq's Flag enums costs more than the send
_LAST = int(zmq.NOBLOCK)


class _FutureWaiter:
    __slots__ = ("future",)

    def __init__(self, future: asyncio.Future) -> None:
        self.future = future

    def chunk(self, chunk: Chunk) -> None:
        pass

    def reply(self, reply: Reply, frames: list[Any]) -> None:
        if not self.future.done():
            self.future.set_result((reply, frames))

    def fail(self, error: ZserveError) -> None:
        if not self.future.done():
            self.future.set_exception(error)


class AsyncClient:
    """An asyncio client; create and use it inside one running event loop."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_ms: int | None = None,
        curve_keys: CurveKeys | None = None,
        cost_of: Mapping[str, Callable[[Any], int]] | None = None,
        blocks_of: Mapping[str, Callable[[Any], list[int]]] | None = None,
    ) -> None:
        """``curve_keys``: as for ``Client``, over a CURVE tcp endpoint. ``cost_of``: per model batched by
        cost (``max_batch_cost``), the cost of a decoded item (the frontends pass each such model's
        ``Model.cost``), so every ``decoded=True`` request of any route carries it. ``blocks_of``: per
        generative model routed cache_aware, the hashes of a decoded item's prompt blocks (the broker routes
        the request to the engine whose cache holds most of them)."""
        self.endpoint = endpoint
        self.timeout_ms = timeout_ms
        self.curve_keys = curve_keys
        self._cost_of = dict(cost_of or {})
        self._blocks_of = dict(blocks_of or {})
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._codec = Codec()
        self._table = PendingTable(endpoint)
        # This turn's requests (and cancels), sent together by _flush at the start of the next one.
        self._items: list[tuple[Submit, list[Any]]] = []
        self._cancels: list[int] = []
        self._flush_pending = False
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
            self._sock = make_socket(self._ctx, zmq.DEALER, self.endpoint, bind=False, curve=self.curve_keys)
            self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | _AUTH_FAILED)
            self._tasks = [asyncio.create_task(t) for t in (self._reader(), self._watchdog(), self._on_disconnect())]
        return self._sock

    # ---- public API ----

    async def predict(
        self,
        model: str,
        body: Any,
        *,
        timeout_ms: int | None = None,
        cost: int = 0,
        priority: int = 0,
        tenant: str = "",
    ) -> Any:
        answer = await self.infer(
            model, body, timeout_ms=timeout_ms, decoded=False, cost=cost, priority=priority, tenant=tenant
        )
        return answer.value

    async def infer(
        self,
        model: str,
        body: Any,
        *,
        timeout_ms: int | None = None,
        decoded: bool = False,
        cost: int = 0,
        priority: int = 0,
        tenant: str = "",
    ) -> Answer:
        """Send one request and await its Answer. ``decoded=True`` means ``body`` is already the output of
        ``decode_request`` (the frontends run it), so the engine runs only ``predict`` and the Answer holds
        the raw output. ``cost``: what the item costs, for a model batched by cost (0: ``cost_of``'s, if
        any). ``priority`` (lower is more urgent) and ``tenant``: see ``zserve.batching.fair_share``; past the
        tenant's quota this raises ``RateLimited``. Cancelling the awaiting task cancels the request in the broker."""
        future = asyncio.get_running_loop().create_future()
        waiter = _FutureWaiter(future)
        req_id = self.start(
            model, body, waiter, timeout_ms=timeout_ms, decoded=decoded, cost=cost, priority=priority, tenant=tenant
        )
        try:
            reply, reply_frames = await future
        except asyncio.CancelledError:
            self.cancel(req_id)
            raise
        return answer_of(reply, reply_frames)

    def start(
        self,
        model: str,
        body: Any,
        waiter: Waiter,
        *,
        timeout_ms: int | None = None,
        decoded: bool = False,
        cost: int = 0,
        priority: int = 0,
        tenant: str = "",
    ) -> int:
        """Send one request whose answer goes to ``waiter`` instead of a future: for a server that answers
        many requests per event-loop turn without a task or a future each (the frontends' fast HTTP path).
        Exactly one of ``waiter.reply(reply, frames)`` (the broker's answer, errors included:
        ``pending.answer_of`` raises its typed error) and ``waiter.fail(error)`` (lost locally: deadline,
        broker gone) is called, in this loop, unless ``cancel`` comes first. A waiter must not raise: it runs
        inside the dispatch of a message that answers other requests too. Raises ``PayloadError`` for a body
        that cannot travel. Returns the request's id, for ``cancel``. Options as for ``infer``."""
        # first: a routed model's blocks_of also adds the prompt's token ids to the body it encodes
        blocks = self._blocks_of[model](body) if decoded and model in self._blocks_of else []
        frames = payload.encode(body)
        if decoded and not cost and self._cost_of:
            cost_fn = self._cost_of.get(model)
            cost = cost_fn(body) if cost_fn is not None else 0
        return self._start(model, frames, timeout_ms, decoded, False, waiter, cost, blocks, priority, tenant)

    def cancel(self, req_id: int) -> None:
        """Forget a request started with ``start`` (its waiter is not called) and cancel it in the broker."""
        self._cancel(req_id)

    async def generate(
        self, prompts: str | list[str], *, model: str, timeout_ms: int | None = None, **sampling: Any
    ) -> list[GenerateResponse]:
        """One response per prompt from a generative model, all in flight together (see ``Client.generate``); one
        that fails, or this call cancelled, cancels the others in the broker."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        values = await gather_or_cancel(
            [self.predict(model, {"prompt": p, **sampling}, timeout_ms=timeout_ms) for p in prompts]
        )
        return [response_of(model, v) for v in values]

    def generate_stream(
        self,
        prompt: str | list[dict[str, str]] | dict[str, Any] | GenerateRequest,
        *,
        model: str,
        timeout_ms: int | None = None,
        decoded: bool = False,
        priority: int = 0,
        tenant: str = "",
        **sampling: Any,
    ) -> AsyncGenerationStream:
        """``async for delta in client.generate_stream("...", model="lm")``; ``prompt`` is a text, chat
        messages, a body, or (with ``decoded=True``, as the frontends do) the ``GenerateRequest`` that
        ``decode_request`` made. The request leaves when iteration starts."""
        blocks = self._blocks_of[model](prompt) if decoded and model in self._blocks_of else []  # before encoding
        body = prompt if isinstance(prompt, (dict, GenerateRequest)) else prompt_body(prompt, sampling)
        frames = payload.encode(body)
        return AsyncGenerationStream(
            model,
            lambda stream: self._start(model, frames, timeout_ms, decoded, True, stream, 0, blocks, priority, tenant),
            self._cancel,
        )

    async def health(self, timeout_s: float = 5.0) -> HealthReport:
        sock = self._socket()
        future = asyncio.get_running_loop().create_future()
        qid = self._table.add_health_query(lambda r: future.done() or future.set_result(r))
        try:
            self._send(sock, [self._codec.encode(HealthQuery(qid))])
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            raise BrokerUnavailable(f"no answer from the broker at {self.endpoint} in {timeout_s}s") from None
        finally:
            self._table.drop_health_query(qid)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._table.fail_all(BrokerUnavailable("the client was closed"))
        if self._sock is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._sock.close(linger=0)
            self._ctx.term()
            self._sock = None

    # ---- coalescing ----

    def _start(
        self,
        model: str,
        frames: list[Any],
        timeout_ms: int | None,
        decoded: bool,
        stream: bool,
        waiter: Any,
        cost: int = 0,
        block_hashes: list[int] | None = None,
        priority: int = 0,
        tenant: str = "",
    ) -> int:
        """Register a request and queue its Submit for this turn's message; its req_id."""
        self._socket()  # created lazily, inside the running loop
        timeout_ms = (timeout_ms if timeout_ms is not None else self.timeout_ms) or 0
        packed = pack(block_hashes) if block_hashes else b""
        submit = Submit(self._table.new_id(), model, timeout_ms, decoded, stream, cost, [], priority, tenant, packed)
        self._table.add(submit, frames, waiter, time.monotonic())
        self._items.append((submit, frames))
        self._schedule_flush()
        return submit.req_id

    def _cancel(self, req_id: int) -> None:
        """Forget a request and tell the broker (in this turn's message, after its Submit if both are)."""
        if self._table.discard(req_id) is not None and self._sock is not None:
            self._cancels.append(req_id)
            self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_pending:
            self._flush_pending = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        sock = self._sock
        if sock is None or sock.closed:
            return
        items, cancels = self._items, self._cancels
        self._items, self._cancels = [], []
        for message in submits_messages(self._codec, items):
            self._send(sock, message)
        for req_id in cancels:
            self._send(sock, [self._codec.encode(Cancel(req_id))])

    def _send(self, sock: zmq.asyncio.Socket, frames: list[Any]) -> None:
        """Send without a future per message (zmq.asyncio's awaitable send costs more than the request it
        carries): the base class's non-blocking send, and only when the pipe is full (far past the HWM in
        practice) an awaited one in a task of its own."""
        try:
            for frame in frames[:-1]:
                zmq.Socket.send(sock, frame, _MORE, copy=False)
            zmq.Socket.send(sock, frames[-1], _LAST, copy=False)
        except zmq.Again:
            self._tasks.append(asyncio.ensure_future(sock.send_multipart(frames, copy=False)))
        # ZMQ's FD is edge-triggered and any call on the socket may consume the edge that announced replies:
        # read them now, or they would wait for the next edge (zmq.asyncio does the same internally).
        self._drain()

    # ---- receiving ----

    def _drain(self) -> None:
        """Read every message already queued, with plain non-blocking receives (no future per message)."""
        sock = self._sock
        now = time.monotonic()
        while sock is not None and zmq.Socket.get(sock, zmq.EVENTS) & zmq.POLLIN:
            frames = [zmq.Socket.recv(sock, zmq.NOBLOCK, copy=False)]
            while frames[-1].more:
                frames.append(zmq.Socket.recv(sock, zmq.NOBLOCK, copy=False))
            msg = self._codec.decode(frames[0].buffer, "broker")
            self._resubmit(self._table.dispatch(msg, received(frames[1:], "the broker"), now))

    def _resubmit(self, items: list[tuple[Submit, list[Any]]]) -> None:
        """Requests the broker lost (it restarted), in the next turn's message (this may run inside a send)."""
        if items:
            self._items += items
            self._schedule_flush()

    async def _on_disconnect(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
            if event & _AUTH_FAILED:
                self._table.fail_all(AuthenticationFailed(f"the broker at {self.endpoint} refused our CURVE key"))
            else:
                self._resubmit(self._table.broker_lost(time.monotonic()))

    async def _reader(self) -> None:
        while True:
            # One awaited wake-up per burst of replies, then a plain drain: under load one wake-up resolves
            # many requests.
            await self._sock.poll(None, zmq.POLLIN)
            self._drain()

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(PING_INTERVAL_S)
            now = time.monotonic()
            for req_id in self._table.expired(now):
                self._cancels.append(req_id)
                self._schedule_flush()
            if self._table.ping_due(now):
                self._send(self._sock, [self._codec.encode(HealthQuery(0))])


async def gather_or_cancel(awaitables: list[Awaitable[T]]) -> list[T]:
    """Every result in order, or the first error with the other pieces cancelled: a cancelled ``infer`` cancels
    its request in the broker, so no work runs on for a call that already failed (or whose caller went away).
    The frontends gather the pieces of every multi-part request with it (completions, embeddings, rerank)."""
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

"""``Client``: thread-safe, blocking or futures. Any thread may call it; one IO thread owns the socket and
sends everything the callers queued since its last turn as one Submits message (coalesced: 500 threads
submitting at once cost the broker one message, not 500)."""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from zserve import payload
from zserve.client.pending import PING_INTERVAL_S, Answer, PendingTable, answer_of
from zserve.client.streams import END, GenerationStream, prompt_body, response_of
from zserve.config import endpoints_for, load_config, run_dir_for
from zserve.errors import BrokerUnavailable, Cancelled, ZserveError
from zserve.frames import pack, received
from zserve.generation import GenerateResponse
from zserve.keys import AuthenticationFailed, CurveKeys
from zserve.protocol import Cancel, Chunk, Codec, HealthQuery, HealthReport, Reply, Submit, Submits
from zserve.transport import make_socket

# The CURVE handshake failed: our key is not authorized, or the broker key is not that broker's.
_AUTH_FAILED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
MAX_ITEMS_PER_MESSAGE = 1024  # bounds one Submits (and the broker's work on it) under a burst


def endpoint_from_config(path: str | os.PathLike[str]) -> str:
    """The broker's client endpoint for the deployment described by ``path`` (a supervisor.toml)."""
    config = load_config(path)
    return endpoints_for(config, run_dir_for(config, path)).client


class _FutureWaiter:
    """Resolves a concurrent Future on the IO thread; for a stream, also feeds its queue of deltas."""

    __slots__ = ("chunks", "future", "meta")

    def __init__(self, future: concurrent.futures.Future, meta: bool, chunks: queue.SimpleQueue | None) -> None:
        self.future = future
        self.meta = meta
        self.chunks = chunks

    def chunk(self, chunk: Chunk) -> None:
        if self.chunks is not None:
            self.chunks.put(chunk)

    def reply(self, reply: Reply, frames: list[Any]) -> None:
        try:
            answer = answer_of(reply, frames)
        except Exception as exc:  # a ZserveError, or a payload that does not decode: never kill the IO thread
            self.future.set_exception(exc)
        else:
            self.future.set_result(answer if self.meta else answer.value)
        if self.chunks is not None:
            self.chunks.put(END)

    def fail(self, error: ZserveError) -> None:
        if not self.future.done():
            self.future.set_exception(error)
        if self.chunks is not None:
            self.chunks.put(END)


@dataclass(slots=True)
class _Outgoing:
    submit: Submit
    frames: list[Any]
    waiter: _FutureWaiter


class Client:
    """A thread-safe, blocking/futures client. ``Client(endpoint)`` or ``Client.from_config(path)``; over tcp
    with CURVE, ``Client("tcp://HOST:PORT", curve_keys=zserve.keys.CurveKeys.load(my_key_secret, broker_key))``
    (a refused key fails every pending request with ``AuthenticationFailed``)."""

    def __init__(self, endpoint: str, *, timeout_ms: int | None = None, curve_keys: CurveKeys | None = None) -> None:
        self.endpoint = endpoint
        self.timeout_ms = timeout_ms
        self.curve_keys = curve_keys
        self._refused: AuthenticationFailed | None = None  # set by the IO thread when the broker refuses our key
        self._ctx = zmq.Context()
        self._table = PendingTable(endpoint)  # the IO thread's only
        # What callers queued for the IO thread (under the lock): sent in this order at its next turn.
        self._lock = threading.Lock()
        self._submits: list[_Outgoing] = []
        self._cancels: list[int] = []
        self._health: list[concurrent.futures.Future] = []
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)  # a full pipe means a wake-up is pending already
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

    def submit(
        self,
        model: str,
        body: Any,
        *,
        timeout_ms: int | None = None,
        meta: bool = False,
        cost: int = 0,
        priority: int = 0,
        tenant: str = "",
    ) -> concurrent.futures.Future:
        """Send one request; the Future resolves to the response (an ``Answer`` with ``meta=True``) or
        raises a ``ZserveError``. ``cost``: what the item costs to compute (e.g. its tokens), for a model
        batched by cost (``max_batch_cost``); 0 counts as 1. ``priority`` (lower is more urgent) and ``tenant``
        ([[tenants]]): see docs/http-api.md; past the tenant's quota the Future raises ``RateLimited``."""
        return self._submit(model, body, timeout_ms, meta, cost=cost, priority=priority, tenant=tenant)[0]

    def predict(
        self,
        model: str,
        body: Any,
        *,
        timeout_ms: int | None = None,
        cost: int = 0,
        priority: int = 0,
        tenant: str = "",
    ) -> Any:
        return self.submit(model, body, timeout_ms=timeout_ms, cost=cost, priority=priority, tenant=tenant).result()

    def infer(
        self,
        model: str,
        body: Any,
        *,
        timeout_ms: int | None = None,
        cost: int = 0,
        priority: int = 0,
        tenant: str = "",
    ) -> Answer:
        """Like ``predict``, with the batch size and queue time the request saw."""
        future = self.submit(model, body, timeout_ms=timeout_ms, meta=True, cost=cost, priority=priority, tenant=tenant)
        return future.result()

    def generate(
        self, prompts: str | list[str], *, model: str, timeout_ms: int | None = None, **sampling: Any
    ) -> list[GenerateResponse]:
        """One response per prompt from a generative model (``CausalLM``). ``sampling``: ``max_new_tokens``,
        ``min_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``, ``stop_token_ids``,
        ``ignore_eos``. The prompts are in flight together, so the engine runs them together; one that fails
        (refused, past its deadline) cancels the others in the broker, as does an exception while waiting."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        started = [self._submit(model, {"prompt": p, **sampling}, timeout_ms, False) for p in prompts]
        try:
            # the first failure, wherever it is, not only once the prompts before it are done
            futures = [future for future, _ in started]
            done, _ = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
            failed = next((f for f in futures if f in done and f.exception() is not None), None)
            if failed is not None:
                failed.result()  # raises
            return [response_of(model, future.result()) for future in futures]
        except BaseException:
            for future, req_id in started:
                if not future.done():
                    self._cancel(req_id)
            raise

    def generate_stream(
        self, prompt: str | list[dict[str, str]], *, model: str, timeout_ms: int | None = None, **sampling: Any
    ) -> GenerationStream:
        """Iterate over the text as it is generated; ``.response`` holds the whole response at the end.
        ``prompt`` is a text, or chat messages ``[{"role": "user", "content": "..."}]``."""
        chunks: queue.SimpleQueue = queue.SimpleQueue()
        future, req_id = self._submit(model, prompt_body(prompt, sampling), timeout_ms, False, chunks)
        return GenerationStream(model, future, chunks, lambda: self._cancel(req_id))

    def health(self, timeout_s: float = 5.0) -> HealthReport:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._check_open()
            self._health.append(future)
        self._wake()
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise self._refused or BrokerUnavailable(
                f"no answer from the broker at {self.endpoint} in {timeout_s}s"
            ) from None

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake()
        self._thread.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ---- callers' side ----

    def _submit(
        self,
        model: str,
        body: Any,
        timeout_ms: int | None,
        meta: bool,
        chunks: queue.SimpleQueue | None = None,
        cost: int = 0,
        priority: int = 0,
        tenant: str = "",
    ) -> tuple[concurrent.futures.Future, int]:
        frames = payload.encode(body)
        timeout_ms = timeout_ms if timeout_ms is not None else self.timeout_ms
        future: concurrent.futures.Future = concurrent.futures.Future()
        req_id = self._table.new_id()  # itertools.count: atomic under the GIL
        submit = Submit(req_id, model, timeout_ms or 0, False, chunks is not None, cost, [], priority, tenant)
        with self._lock:
            self._check_open()
            first = not self._submits and not self._cancels
            self._submits.append(_Outgoing(submit, frames, _FutureWaiter(future, meta, chunks)))
        if first:  # later callers of this turn find the wake-up pending
            self._wake()
        return future, req_id

    def _cancel(self, req_id: int) -> None:
        with self._lock:
            if self._closed:
                return
            self._cancels.append(req_id)
        self._wake()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("client is closed")

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

    # ---- the IO thread ----

    def _io_loop(self) -> None:
        codec = Codec()
        sock = make_socket(self._ctx, zmq.DEALER, self.endpoint, bind=False, curve=self.curve_keys)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | _AUTH_FAILED)  # the broker went away: resubmit
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        table = self._table
        try:
            while True:
                events = dict(poller.poll(int(PING_INTERVAL_S * 1000)))
                if self._wake_r in events:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                    with self._lock:
                        submits, cancels, health, closed = self._submits, self._cancels, self._health, self._closed
                        self._submits, self._cancels, self._health = [], [], []
                    if closed:
                        self._fail_unsent(submits, health)
                        return
                    self._send_submits(sock, codec, submits)
                    for req_id in cancels:  # after the submits: a request may be cancelled in its own turn
                        waiter = table.discard(req_id)
                        if waiter is not None:
                            sock.send(codec.encode(Cancel(req_id)))
                            waiter.fail(Cancelled("cancelled by the caller"))
                    for future in health:
                        qid = table.add_health_query(lambda r, f=future: f.done() or f.set_result(r))
                        sock.send(codec.encode(HealthQuery(qid)))
                if sock in events:
                    now = time.monotonic()
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        msg = codec.decode(frames[0].buffer, "broker")
                        resend = table.dispatch(msg, received(frames[1:], "the broker"), now)
                        if resend:
                            _send_items(sock, codec, resend)
                now = time.monotonic()
                if monitor in events:
                    refused = False
                    while monitor.poll(0):
                        refused |= bool(recv_monitor_message(monitor)["event"] & _AUTH_FAILED)
                    if refused:  # no answer will ever come: say why rather than time out
                        self._refused = AuthenticationFailed(f"the broker at {self.endpoint} refused our CURVE key")
                        table.fail_all(self._refused)
                    else:
                        _send_items(sock, codec, table.broker_lost(now))
                for req_id in table.expired(now):
                    sock.send(codec.encode(Cancel(req_id)))
                if table.ping_due(now):
                    sock.send(codec.encode(HealthQuery(0)))
        finally:
            table.fail_all(BrokerUnavailable("the client was closed"))
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
            self._ctx.term()

    def _send_submits(self, sock: zmq.Socket, codec: Codec, submits: list[_Outgoing]) -> None:
        now = time.monotonic()
        leaving = []
        for out in submits:
            if out.waiter.future.set_running_or_notify_cancel():  # else the caller cancelled it meanwhile
                self._table.add(out.submit, out.frames, out.waiter, now)
                leaving.append((out.submit, out.frames))
        _send_items(sock, codec, leaving)

    @staticmethod
    def _fail_unsent(submits: list[_Outgoing], health: list[concurrent.futures.Future]) -> None:
        """Queued just before close: answer them too."""
        for out in submits:
            if out.waiter.future.set_running_or_notify_cancel():
                out.waiter.fail(BrokerUnavailable("the client was closed"))
        for future in health:
            if not future.done():
                future.set_exception(BrokerUnavailable("the client was closed"))


def submits_messages(codec: Codec, items: list[tuple[Submit, list[Any]]]) -> list[list[Any]]:
    """The wire messages (header + packed frames) for requests: one Submits per MAX_ITEMS_PER_MESSAGE."""
    messages = []
    for start in range(0, len(items), MAX_ITEMS_PER_MESSAGE):
        part = items[start : start + MAX_ITEMS_PER_MESSAGE]
        header = Submits([submit for submit, _ in part], [len(frames) for _, frames in part])
        messages.append([codec.encode(header), *pack([f for _, frames in part for f in frames])])
    return messages


def _send_items(sock: zmq.Socket, codec: Codec, items: list[tuple[Submit, list[Any]]]) -> None:
    for message in submits_messages(codec, items):
        sock.send_multipart(message, copy=False)

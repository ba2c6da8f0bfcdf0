"""Both clients coalesce: what is submitted in one turn leaves as one Submits message. A fake broker (a real
ROUTER socket on ipc) counts the messages and answers each with one Replies."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from pathlib import Path

import pytest
import zmq

from zserve import AsyncClient, BadRequest, Client, ZserveError
from zserve.client.pending import answer_of
from zserve.frames import pack, unpack
from zserve.protocol import Chunk, Codec, Replies, Reply, Status, Submits


class FakeBroker:
    """Echoes every request's payload; a request for model "bad" is refused. Records each message's size."""

    def __init__(self) -> None:
        self.endpoint = f"ipc://{tempfile.mkdtemp(prefix='zs-')}/client.sock"
        self.sizes: list[int] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.bind(self.endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        codec = Codec()
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            identity, header, *wire = self._sock.recv_multipart()
            msg = codec.decode(header)
            frames = unpack(wire)
            if not isinstance(msg, Submits):
                continue
            self.sizes.append(len(msg.items))
            replies, counts, out, offset = [], [], [], 0
            for item, count in zip(msg.items, msg.frame_counts, strict=True):
                if item.model == "bad":
                    replies.append(Reply(item.req_id, Status.BAD_REQUEST, "refused", "text"))
                    counts.append(0)
                else:
                    replies.append(Reply(item.req_id, Status.OK, batch_size=len(msg.items)))
                    counts.append(count)
                    out.extend(frames[offset : offset + count])
                offset += count
            self._sock.send_multipart([identity, codec.encode(Replies(replies, counts)), *pack(out)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(0)
        self._ctx.term()
        shutil.rmtree(Path(self.endpoint.removeprefix("ipc://")).parent, ignore_errors=True)


@pytest.fixture
def broker():
    b = FakeBroker()
    yield b
    b.close()


@pytest.mark.parametrize("n", [0, 1, 500])
def test_async_client_sends_one_message_per_event_loop_turn(broker, n):
    async def main() -> list:
        client = AsyncClient(broker.endpoint)
        try:
            # all created in this turn: the tasks start together in the next one, so they coalesce
            tasks = [asyncio.create_task(client.infer("echo", {"i": i})) for i in range(n)]
            if n == 1:
                tasks.append(asyncio.create_task(client.infer("bad", {"i": -1})))
            return await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await client.close()

    results = asyncio.run(main())
    if n == 0:
        assert results == [] and broker.sizes == []
        return
    answers = results[:n]
    assert [a.value for a in answers] == [{"i": i} for i in range(n)]
    assert broker.sizes == [len(results)]  # one message for the whole turn
    if n == 1:
        assert isinstance(results[1], BadRequest) and results[1].field == "text"  # fails alone


def test_sync_client_coalesces_submits_from_many_threads(broker):
    with Client(broker.endpoint) as client:
        futures: list = []
        lock = threading.Lock()

        def caller(k: int) -> None:
            mine = [client.submit("echo", {"k": k, "i": i}) for i in range(50)]
            with lock:
                futures.extend(mine)

        threads = [threading.Thread(target=caller, args=(k,)) for k in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        values = [f.result(timeout=10) for f in futures]
    assert sorted((v["k"], v["i"]) for v in values) == [(k, i) for k in range(10) for i in range(50)]
    assert sum(broker.sizes) == 500
    assert len(broker.sizes) < 500 and max(broker.sizes) > 1  # several requests per message


class Collect:
    """A waiter for AsyncClient.start that records what it is told."""

    def __init__(self, done: asyncio.Event, expected: int) -> None:
        self.got: list = []
        self.done, self.expected = done, expected

    def chunk(self, chunk: Chunk) -> None:
        raise AssertionError("predict requests do not stream")

    def reply(self, reply: Reply, frames: list) -> None:
        try:
            self.got.append(("reply", reply.req_id, answer_of(reply, frames).value))
        except ZserveError as exc:  # a reply that is an error (what the fast HTTP path's waiter does too)
            return self.fail(exc)
        self._check()

    def fail(self, error: Exception) -> None:
        self.got.append(("fail", type(error).__name__, getattr(error, "field", "")))
        self._check()

    def _check(self) -> None:
        if len(self.got) == self.expected:
            self.done.set()


def test_async_client_start_answers_waiters_and_a_cancelled_request_is_not_answered(broker):
    async def main() -> tuple[list, list[int], list[int]]:
        client = AsyncClient(broker.endpoint)
        try:
            done = asyncio.Event()
            waiter = Collect(done, expected=4)
            ids = [client.start("echo", {"i": i}, waiter) for i in range(3)]
            ids.append(client.start("bad", {"i": -1}, waiter))  # refused: fails alone
            cancelled = client.start("echo", {"i": 99}, Collect(asyncio.Event(), expected=1))
            client.cancel(cancelled)  # in the same turn: the broker gets it, the waiter is never called
            await asyncio.wait_for(done.wait(), 10)
            await asyncio.sleep(0.05)  # room for a wrong extra answer to arrive
            return waiter.got, ids, broker.sizes
        finally:
            await client.close()

    got, ids, sizes = asyncio.run(main())
    assert got[:2] == [("reply", ids[0], {"i": 0}), ("reply", ids[1], {"i": 1})]
    assert sorted(got, key=str) == sorted(
        [("reply", ids[0], {"i": 0}), ("reply", ids[1], {"i": 1}), ("reply", ids[2], {"i": 2}),
         ("fail", "BadRequest", "text")], key=str)  # fmt: skip
    assert sizes == [5]  # one message for the turn, the cancelled request in it

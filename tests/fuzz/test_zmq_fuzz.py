"""Fuzzed ZeroMQ frames at each of the broker's bound sockets (client ROUTER, work ROUTER, out PULL), sent
with raw pyzmq: random bytes, wrong tags, truncated headers, valid headers with wrong payload counts and
wrong field types, oversize frames. The broker must stay up and keep serving (a health query answered
after every case, a real request served at the end), every well-formed Submit must get exactly one Reply,
and what it drops must be logged."""

from __future__ import annotations

import itertools
import time

import msgspec
import pytest
import zmq
from cluster import Cluster
from fuzzing import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

import zserve
from zserve.frames import pack
from zserve.protocol import (
    BatchResult,
    Cancel,
    Codec,
    HealthQuery,
    Heartbeat,
    Hello,
    Replies,
    StepOutput,
    Submit,
    Submits,
)

CONFIG = """
[broker]
heartbeat_interval_ms = 100
heartbeat_liveness = 5

[[models]]
name = "slow"
handler = "testmodels:SlowEcho"
max_batch_size = 8
max_wait_ms = 2
timeout_ms = 5000
[models.options]
delay_s = 0.0
"""

counted: dict[str, int] = {}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(CONFIG, tmp_path_factory.mktemp("zmqfuzz"))
    c.start_broker()
    c.start_engine("slow", 0)
    c.wait_ready({"slow": 1})
    c.health_client = c.client()
    yield c
    print("\nZeroMQ fuzz cases per socket:", counted)
    try:
        assert c.procs["broker"].poll() is None, c.log("broker")
        assert "dropped malformed frame" in c.log("broker")
    finally:
        c.stop()


ints = st.integers(-(2**63), 2**64 - 1)
scalars = st.none() | st.booleans() | ints | st.floats(allow_nan=False) | st.text(max_size=8) | st.binary(max_size=8)
anything = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3), max_leaves=6)
int_lists = st.lists(st.integers(-3, 6) | anything, max_size=4)
payloads = st.lists(st.binary(max_size=40), max_size=4)


def msgpack(value) -> bytes:
    return msgspec.msgpack.encode(value)


random_frames = st.lists(st.binary(max_size=64), min_size=1, max_size=5)
wrong_tags = st.tuples(st.integers(-5, 300) | st.text(max_size=3), st.lists(anything, max_size=5)).map(
    lambda t: [msgpack([t[0], *t[1]])]
)


def with_payload(header: st.SearchStrategy) -> st.SearchStrategy:
    """A header followed by packed payload frames (their number chosen apart from what it says), or by raw
    frames that are not a valid layout at all."""
    return st.tuples(header, payloads, st.booleans(), st.lists(st.binary(max_size=16), max_size=3)).map(
        lambda t: [Codec().encode(t[0]), *(pack(t[1]) if t[2] else t[3])]
    )


def truncated(messages: st.SearchStrategy) -> st.SearchStrategy:
    return st.tuples(messages, st.integers(0, 200)).map(lambda t: [t[0][0][: t[1] % max(1, len(t[0][0]))]])


client_headers = st.one_of(
    st.builds(Submit, req_id=ints | anything, model=st.sampled_from(["slow", "nope"]) | anything,
              timeout_ms=st.integers(-10, 10_000) | anything, decoded=st.booleans() | anything,
              stream=st.booleans() | anything),
    st.builds(Submits, items=st.lists(st.builds(Submit, req_id=ints, model=st.just("slow") | anything), max_size=3),
              frame_counts=int_lists),
    st.builds(Cancel, req_id=ints | anything),
    st.builds(HealthQuery, query_id=anything),
)  # fmt: skip
work_headers = st.builds(
    Hello, worker=st.text(max_size=8) | anything,
    pid=st.just(0) | st.integers(2**22 + 1, 2**31 - 1),  # never a live process: the broker may SIGKILL a hung pid
    role=st.sampled_from(["engine", "preprocess", "other"]) | anything, models=st.lists(st.just("slow") | anything,
    max_size=2), credits=st.integers(-2, 4) | anything, protocol=st.integers(0, 3) | anything,
)  # fmt: skip
out_headers = st.one_of(
    st.builds(BatchResult, batch_id=ints | anything, worker=st.text(max_size=8) | anything, statuses=int_lists,
              messages=st.lists(st.text(max_size=5) | anything, max_size=3), fields=st.lists(anything, max_size=3),
              frame_counts=int_lists),
    st.builds(Heartbeat, sender=st.text(max_size=8) | anything, busy=st.booleans() | anything),
    st.builds(StepOutput, worker=st.text(max_size=8) | anything, batch_ids=int_lists, texts=st.lists(anything,
              max_size=3), num_tokens=int_lists, finished=st.lists(st.booleans() | anything, max_size=3),
              statuses=int_lists, messages=st.lists(anything, max_size=3), frame_counts=int_lists),
)  # fmt: skip


def junk(headers: st.SearchStrategy) -> st.SearchStrategy:
    valid = with_payload(headers)
    return st.one_of(random_frames, wrong_tags, valid, truncated(valid))


def still_serving(cluster: Cluster) -> None:
    assert cluster.procs["broker"].poll() is None, cluster.log("broker")
    cluster.health_client.health(timeout_s=5.0)  # raises if the broker stopped answering


@pytest.mark.parametrize("socket_name", ["client", "work", "out"])
def test_fuzzed_frames_leave_the_broker_serving(cluster, socket_name):
    endpoint = getattr(cluster.plan.endpoints, socket_name)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH if socket_name == "out" else zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    headers = {"client": client_headers, "work": work_headers, "out": out_headers}[socket_name]

    @fuzz_settings(150)
    @given(frames=junk(headers))
    def fuzz(frames):
        counted[socket_name] = counted.get(socket_name, 0) + 1
        sock.send_multipart(frames)
        still_serving(cluster)

    try:
        fuzz()
        # oversize: a 4 MiB header that is not msgpack, then a valid one naming a 4 MiB model, with 1 MiB payloads
        sock.send_multipart([b"\xc1" + bytes(4 << 20), bytes(1 << 20)])
        sock.send_multipart([Codec().encode(Submits([Submit(1, "m" * (4 << 20))], [1])), *pack([bytes(1 << 20)])])
        sock.send_multipart([Codec().encode(HealthQuery(1)), *([bytes(70_000)] * 64)])
        still_serving(cluster)
    finally:
        sock.close(0)
        ctx.term()
    deadline = time.monotonic() + 10  # fake workers from the fuzzed Hellos expire; then real work is served
    while True:
        try:
            assert cluster.health_client.predict("slow", socket_name, timeout_ms=2000)["echo"] == socket_name
            break
        except zserve.ZserveError:
            if time.monotonic() > deadline:
                raise


def test_every_well_formed_submit_gets_exactly_one_reply(cluster):
    """Valid Submits with random model names, timeouts, payload counts and payload bytes: each req_id is
    answered once (OK, BAD_REQUEST, UNKNOWN_MODEL...), none is left unanswered."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(cluster.plan.endpoints.client)
    ids = itertools.count(1)
    sent: list[int] = []
    items = st.builds(lambda model, timeout_ms, decoded: (model, timeout_ms, decoded),
                      st.sampled_from(["slow", "nope", ""]), st.integers(0, 3000), st.booleans())  # fmt: skip

    @fuzz_settings(100)
    @given(batch=st.lists(st.tuples(items, payloads), min_size=1, max_size=4), skew=st.integers(-2, 2))
    def fuzz(batch, skew):
        counted["client, well formed"] = counted.get("client, well formed", 0) + 1
        submits = [Submit(next(ids), model, timeout_ms, decoded) for (model, timeout_ms, decoded), _ in batch]
        counts = [len(frames) for _, frames in batch]
        counts[0] = max(0, counts[0] + skew)  # wrong payload counts: the frames no longer line up
        sent.extend(s.req_id for s in submits)
        sock.send_multipart([Codec().encode(Submits(submits, counts)), *pack([f for _, fs in batch for f in fs])])

    try:
        fuzz()
        answers: dict[int, int] = {}
        deadline = time.monotonic() + 15
        codec = Codec()
        while len(answers) < len(sent) and time.monotonic() < deadline:
            if sock.poll(200):
                msg = codec.decode(sock.recv_multipart()[0])
                if isinstance(msg, Replies):
                    for reply in msg.items:
                        answers[reply.req_id] = answers.get(reply.req_id, 0) + 1
    finally:
        sock.close(0)
        ctx.term()
    assert sorted(answers) == sorted(sent), f"unanswered: {sorted(set(sent) - set(answers))[:20]}"
    assert set(answers.values()) == {1}


@pytest.mark.parametrize(
    "header", [b"\x81", b"\x80\x00", b"\x91\x00\x00"], ids=["truncated-map", "map-then-byte", "bad-tag-then-bytes"]
)
def test_a_header_that_is_not_an_array_and_not_msgpack_is_dropped(tmp_path, header):
    """One frame from any client (a msgpack map, truncated or with bytes after it; an unknown tag with bytes
    after it) is logged and dropped: the broker keeps answering (it used to exit on these)."""
    c = Cluster(CONFIG, tmp_path)
    try:
        c.start_broker()
        c.wait_ready({})
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(c.plan.endpoints.client)
        sock.send(header)
        sock.send(Codec().encode(HealthQuery(7)))
        answered = sock.poll(3000)
        sock.close(0)
        ctx.term()
        assert answered and c.procs["broker"].poll() is None, c.log("broker")[-600:]
    finally:
        c.stop()

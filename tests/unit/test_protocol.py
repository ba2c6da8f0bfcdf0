from __future__ import annotations

import logging

import msgspec
import pytest

from zserve import protocol as p


@pytest.mark.parametrize(
    "msg",
    [
        p.Submit(1 << 40, "m", 100, True),
        p.Cancel(3),
        p.Reply(4, p.Status.BAD_REQUEST, "no", "text", 8, 1.5, 2.5),
        p.HealthQuery(9),
        p.HealthReport(9, 123, False, [p.ModelHealth("m", 2, 3, 4, 1)]),
        p.Hello("engine-m-0:12", 12, "engine", ["m"], 2),
        p.Batch(5, "m", [1, 2], [1, 2], [True, False]),
        p.BatchResult(5, "w", [p.Status.OK, p.Status.INTERNAL], ["", "x"], ["", ""], [1, 0], 3.0),
        p.Heartbeat("w", True),
        p.Reset("why"),
        p.Shutdown("bye"),
    ],
)
def test_every_message_round_trips(msg):
    codec = p.Codec()
    assert codec.decode(codec.encode(msg)) == msg


def test_malformed_frames_are_logged_with_the_sender_and_dropped(caplog):
    codec = p.Codec()
    with caplog.at_level(logging.WARNING, logger="zserve.protocol"):
        assert codec.decode(b"\xc1garbage", "client b'x'") is None
        assert codec.decode(msgspec.msgpack.encode([999, 1]), "worker w") is None  # unknown tag
        assert codec.decode(msgspec.msgpack.encode([1, "not an int", "m"]), "client c") is None
    assert "client b'x'" in caplog.text and "worker w" in caplog.text


def test_an_older_peer_decodes_a_message_with_appended_fields():
    class SubmitV2(p.Msg, tag=1):
        req_id: int
        model: str
        timeout_ms: int = 0
        decoded: bool = False
        stream: bool = False
        cost: int = 0
        block_hashes: list[int] = []
        priority: int = 0
        tenant: str = ""
        block_hashes_packed: bytes = b""
        later: int = 0  # appended in a newer version

    data = msgspec.msgpack.encode(SubmitV2(1, "m", 5, True, True, 7, [2**64 - 1], -1, "t", b"\xff" * 8, later=3))
    assert p.Codec().decode(data) == p.Submit(1, "m", 5, True, True, 7, [2**64 - 1], -1, "t", b"\xff" * 8)
    # and a newer peer fills defaults when an older one omits trailing fields
    assert p.Codec().decode(msgspec.msgpack.encode([1, 7, "m"])) == p.Submit(7, "m")

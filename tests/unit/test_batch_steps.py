"""The engine's batch logic, without sockets: failures stay with their item."""

from __future__ import annotations

from testmodels import Picky

from zserve import payload
from zserve.models.echo import Echo
from zserve.protocol import Batch, Status
from zserve.workers.engine import BatchSteps


def run(model, items, decoded=False):
    frames, counts = [], []
    for item in items:
        f = payload.encode(item)
        frames += f
        counts.append(len(f))
    batch = Batch(1, "m", list(range(len(items))), counts, [decoded] * len(items))
    result, out = BatchSteps(model, "w").run(batch, frames)
    values, offset = [], 0
    for status, count in zip(result.statuses, result.frame_counts, strict=True):
        values.append(payload.decode(out[offset : offset + count]) if status == Status.OK else None)
        offset += count
    return result, values


def test_one_bad_item_fails_alone():
    result, values = run(Picky(), ["a", "boom", "b", {"reject": 1}, "unencodable"])
    assert result.statuses == [Status.OK, Status.INTERNAL, Status.OK, Status.BAD_REQUEST, Status.INTERNAL]
    assert values[0] == {"ok": "a"} and values[2] == {"ok": "b"}
    assert "ValueError: boom" in result.messages[1]
    assert result.fields[3] == "reject"
    assert "encode_response" in result.messages[4]


def test_wrong_number_of_outputs_fails_the_batch_and_says_so():
    result, _ = run(Picky(), ["a", "short", "b"])
    assert result.statuses == [Status.INTERNAL] * 3
    assert "returned 2 outputs for a batch of 3" in result.messages[0]


def test_decoded_items_skip_the_request_and_response_hooks():
    result, values = run(Picky(), [{"reject": 1}, "unencodable"], decoded=True)
    assert result.statuses == [Status.OK, Status.OK]  # the frontend runs the hooks for decoded items
    assert values == [{"ok": {"reject": 1}}, {"ok": "unencodable"}]


def test_a_malformed_payload_is_a_bad_request():
    batch = Batch(1, "m", [1, 2], [1, 1], [False, False])
    result, out = BatchSteps(Echo(), "w").run(batch, [b"\xc1", payload.encode(5)[0]])
    assert result.statuses == [Status.BAD_REQUEST, Status.OK]
    assert payload.decode(out) == 5

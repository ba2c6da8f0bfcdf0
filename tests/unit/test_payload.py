from __future__ import annotations

import numpy as np
import pytest
import torch

from zserve import payload


def test_plain_values_round_trip_in_one_frame():
    value = {"text": "héllo 🌍", "n": [1, 2.5, None, True]}
    frames = payload.encode(value)
    assert len(frames) == 1
    assert payload.decode(frames) == value


def test_arrays_travel_as_raw_frames_with_dtype_and_shape():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.array([[1, 2]], dtype=np.int64)
    value = {"input_ids": b, "nested": [a, {"empty": np.zeros((0, 3), np.float16)}], "t": torch.ones(2, 2)}
    frames = payload.encode(value)
    assert len(frames) == 5
    assert bytes(frames[1]) == b.tobytes()  # raw bytes, not pickled, not inside the msgpack body
    out = payload.decode([bytes(f) for f in frames])
    np.testing.assert_array_equal(out["input_ids"], b)
    np.testing.assert_array_equal(out["nested"][0], a)
    assert out["nested"][0].dtype == np.float32
    assert out["nested"][1]["empty"].shape == (0, 3)
    np.testing.assert_array_equal(out["t"], np.ones((2, 2), np.float32))


def test_non_contiguous_arrays_and_numpy_scalars():
    a = np.arange(16, dtype=np.int32).reshape(4, 4)[:, 1]
    out = payload.decode([bytes(f) for f in payload.encode({"a": a, "s": np.float32(1.5)})])
    np.testing.assert_array_equal(out["a"], a)
    assert out["s"] == 1.5


def test_errors_are_typed():
    with pytest.raises(payload.PayloadError, match="object"):
        payload.encode(object())
    with pytest.raises(payload.PayloadError):
        payload.decode([b"\xc1"])
    with pytest.raises(payload.PayloadError):
        payload.decode([])


def test_frames_pack_small_ones_and_pass_large_ones_untouched():
    import numpy as np

    from zserve.frames import PACK_MAX_BYTES, FrameError, pack, received, unpack

    big = np.arange(PACK_MAX_BYTES, dtype=np.uint8)
    frames = [b"ab", b"", memoryview(big), b"xyz"]
    wire = pack(frames)
    assert len(wire) == 3 and wire[2] is frames[2]  # the large frame is not copied
    assert [bytes(f) for f in unpack(wire)] == [bytes(f) for f in frames]
    assert pack([]) == [] and unpack([]) == []
    for bad in ([wire[0]], [wire[0], wire[1]], [b"\x01\x02\x03", b""], [wire[0], wire[1] + b"!", wire[2]]):
        with pytest.raises(FrameError):
            unpack(bad)
    assert received([b"\x01"], "test") == []  # a receiver reads a malformed payload as none

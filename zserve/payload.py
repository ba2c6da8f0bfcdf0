"""Payloads: any msgpack-able Python value, with arrays carried as raw frames beside it.

``encode(value)`` returns frames: frame 0 is msgpack of the value in which every numpy array (or CPU
torch tensor) is replaced by a small extension record ``(dtype, shape, frame index)``; the array's bytes
follow as their own frames, never pickled and never copied into the msgpack body. ``decode(frames)``
reverses it; arrays come back as read-only numpy views over the received frames (no copy).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

_EXT_ARRAY = 1
_local = threading.local()
_ARRAY_META = msgspec.msgpack.Decoder(tuple[str, tuple[int, ...], int])


class PayloadError(ValueError):
    """A payload could not be encoded (an unsupported type) or decoded (malformed frames)."""


def _to_numpy(obj: Any) -> np.ndarray | None:
    if isinstance(obj, np.ndarray):
        return obj
    # torch is optional here: recognise a tensor without importing torch.
    if type(obj).__module__ == "torch" and type(obj).__name__ in ("Tensor", "Parameter"):
        return obj.detach().cpu().contiguous().numpy()
    return None


class _Encoder:
    def __init__(self) -> None:
        self.frames: list[Any] = []
        self.msgpack = msgspec.msgpack.Encoder(enc_hook=self._hook)
        self.meta = msgspec.msgpack.Encoder()

    def _hook(self, obj: Any) -> Any:
        array = _to_numpy(obj)
        if array is not None:
            if array.dtype.hasobject:
                raise PayloadError("arrays of Python objects cannot travel as raw frames")
            array = np.ascontiguousarray(array)
            self.frames.append(memoryview(array).cast("B") if array.size else b"")
            index = len(self.frames) - 1
            return msgspec.msgpack.Ext(_EXT_ARRAY, self.meta.encode((array.dtype.str, array.shape, index)))
        if isinstance(obj, np.generic):
            return obj.item()
        raise PayloadError(f"cannot encode a value of type {type(obj).__name__}")


def encode(value: Any) -> list[Any]:
    """Frames for ``value``: ``[msgpack body, *array buffers]``."""
    enc = getattr(_local, "encoder", None)
    if enc is None:
        enc = _local.encoder = _Encoder()
    enc.frames = [b""]
    try:
        enc.frames[0] = enc.msgpack.encode(value)
    except PayloadError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise PayloadError(str(exc)) from exc
    frames, enc.frames = enc.frames, []
    return frames


def _buffer(frame: Any) -> Any:
    return frame.buffer if hasattr(frame, "buffer") else frame  # zmq.Frame or bytes-like


def decode(frames: Sequence[Any]) -> Any:
    """The value that ``encode`` turned into ``frames`` (zmq.Frame or bytes-like)."""
    if not frames:
        raise PayloadError("empty payload")

    def ext_hook(code: int, data: memoryview) -> Any:
        if code != _EXT_ARRAY:
            raise PayloadError(f"unknown payload extension {code}")
        dtype, shape, index = _ARRAY_META.decode(data)
        if not 0 < index < len(frames):
            raise PayloadError(f"array frame {index} missing")
        return np.frombuffer(_buffer(frames[index]), dtype=np.dtype(dtype)).reshape(shape)

    try:
        return msgspec.msgpack.decode(_buffer(frames[0]), ext_hook=ext_hook)
    except PayloadError:
        raise
    except (msgspec.DecodeError, ValueError, TypeError) as exc:
        raise PayloadError(f"malformed payload: {exc}") from exc


def to_jsonable(obj: Any) -> Any:
    """msgspec JSON ``enc_hook``: arrays and tensors become nested lists, numpy scalars plain numbers."""
    array = _to_numpy(obj)
    if array is not None:
        return array.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode a value of type {type(obj).__name__} as JSON")

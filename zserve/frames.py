"""How a message's payload frames travel: small ones packed into one frame, large ones as they are.

A message is ``[header, *payload frames]`` to every layer above this module. On the wire it is
``[header]`` when there are no payload frames, else ``[header, layout, blob, *large]``: ``layout`` is one
little-endian int32 per payload frame, its size if it is packed in ``blob`` (in order), or -1 if it is the
next of the ``large`` frames. A coalesced message of 500 small requests is then 3 ZeroMQ frames, not 501
(each frame costs a few microseconds in pyzmq; the copy of a small one into the blob costs nanoseconds);
an array of ``PACK_MAX_BYTES`` or more is never copied.

``unpack`` returns memoryviews over the received frames (no copy): slices of the blob, and the large
frames' buffers. It raises ``FrameError`` for a layout that does not match the frames.
"""

from __future__ import annotations

import logging
import sys
from array import array
from collections.abc import Sequence
from typing import Any

import zmq

log = logging.getLogger("zserve.frames")

PACK_MAX_BYTES = 16 * 1024
_LARGE = -1
_SWAP = sys.byteorder != "little"


class FrameError(ValueError):
    """The frames of a message do not match its layout."""


def pack(frames: Sequence[Any]) -> list[Any]:
    """The wire frames after the header for ``frames`` (bytes-like or zmq.Frame); [] for none."""
    if not frames:
        return []
    layout = array("i")
    small: list[Any] = []
    large: list[Any] = []
    for frame in frames:
        if type(frame) is zmq.Frame:
            frame = frame.buffer
        size = len(frame) if type(frame) is bytes else memoryview(frame).nbytes
        if size < PACK_MAX_BYTES:
            layout.append(size)
            small.append(frame)
        else:
            layout.append(_LARGE)
            large.append(frame)
    if _SWAP:
        layout.byteswap()
    return [layout.tobytes(), b"".join(small), *large]


def unpack(wire: Sequence[Any]) -> list[memoryview]:
    """The payload frames of a message from its wire frames after the header (zmq.Frame or bytes-like)."""
    if not wire:
        return []
    if len(wire) < 2:
        raise FrameError("a payload without its blob frame")
    layout = array("i")
    try:
        layout.frombytes(_buffer(wire[0]))
    except ValueError:
        raise FrameError("a layout frame whose size is not a multiple of 4") from None
    if _SWAP:
        layout.byteswap()
    blob = memoryview(_buffer(wire[1]))
    out: list[memoryview] = []
    offset = 0
    large = 2
    for size in layout:
        if size >= 0:
            out.append(blob[offset : offset + size])
            offset += size
        elif size == _LARGE and large < len(wire):
            out.append(memoryview(_buffer(wire[large])))
            large += 1
        else:
            raise FrameError(f"layout entry {size} with {len(wire) - 2} large frames")
    if offset != blob.nbytes or large != len(wire):
        raise FrameError(f"layout accounts for {offset} of {blob.nbytes} blob bytes, {large - 2} of {len(wire) - 2}")
    return out


def received(wire: Sequence[Any], sender: str) -> list[memoryview]:
    """``unpack``, for a receiver: a malformed payload is logged and read as no payload at all, which
    fails the message's items with a clear error (their frame counts no longer add up)."""
    try:
        return unpack(wire)
    except FrameError as exc:
        log.warning("malformed payload frames from %s: %s", sender, exc)
        return []


def _buffer(frame: Any) -> Any:
    return frame.buffer if type(frame) is zmq.Frame else frame

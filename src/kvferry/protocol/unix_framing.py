"""Framing on the server's Unix socket (both directions): a 4-byte little-endian length, then that many bytes of one
message (the same msgpack map that travels as one ZMQ frame, `kvferry.protocol.messages`)."""

from __future__ import annotations

import struct

HEADER = struct.Struct("<I")


def frame(payload: bytes) -> bytes:
    """One message as it travels on the Unix socket (both directions)."""
    return HEADER.pack(len(payload)) + payload


class FrameTooLarge(ValueError):
    """A frame announcing more bytes than the reader takes."""


def take_frames(inbox: bytearray, data: bytes, max_bytes: int | None = None) -> list[memoryview]:
    """The whole frames in what came so far: `inbox` (the unfinished frame of earlier reads), then `data` just
    read. An unfinished frame stays in `inbox`. The frames are views of bytes nobody changes: one copy less than
    slicing the buffer, and usually none at all (a read holds whole frames)."""
    if inbox:
        inbox += data
        if len(inbox) < HEADER.size:
            return []
        (size,) = HEADER.unpack_from(inbox)
        _check_size(size, max_bytes)
        if len(inbox) < HEADER.size + size:
            return []  # a large frame comes in many reads: each only appends, nothing is copied until it is whole
        data = bytes(inbox)
        inbox.clear()
    view = memoryview(data)
    frames = []
    start, length = 0, len(data)
    while length - start >= HEADER.size:
        (size,) = HEADER.unpack_from(data, start)
        _check_size(size, max_bytes)
        end = start + HEADER.size + size
        if length < end:
            break
        frames.append(view[start + HEADER.size : end])
        start = end
    if start < length:
        inbox += view[start:]
    return frames


def _check_size(size: int, max_bytes: int | None) -> None:
    if max_bytes is not None and size > max_bytes:
        raise FrameTooLarge(f"a {size}-byte frame (max_message_bytes={max_bytes})")

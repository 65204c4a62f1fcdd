"""Whole-file object I/O in aligned blocks, with O_DIRECT where the filesystem allows it.

An object file is `header (a multiple of BLOCK) | payload | zero padding to a multiple of BLOCK`, the same
whichever mode wrote it. With O_DIRECT the payload moves straight between the tensor and the device when the
tensor is block-aligned (the host pool aligns to 4096) and through a small per-thread bounce buffer otherwise;
only the last partial block always goes through the bounce buffer. O_DIRECT keeps a large disk cache from
evicting the page cache the rest of the machine lives on.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading

import numpy as np

from kvferry.tiers.header import CorruptObject

BLOCK = 4096
_BOUNCE_BYTES = 4 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_local = threading.local()


def padded_size(header_len: int, payload_len: int) -> int:
    """Bytes an object file occupies."""
    return header_len + -(-payload_len // BLOCK) * BLOCK


def supports_direct(directory: str) -> bool:
    """Whether files in `directory` accept O_DIRECT writes (tmpfs and some network filesystems do not)."""
    if not _O_DIRECT:
        return False
    path = os.path.join(directory, f".direct-probe-{os.getpid()}-{threading.get_ident()}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | _O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.pwrite(fd, _bounce()[:BLOCK], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)


def write_object(path: str, header: bytes, payload: memoryview, *, direct: bool, fsync: bool) -> None:
    """Create `path` (which must not exist) holding header + payload + padding."""
    if len(header) % BLOCK:
        raise ValueError(f"header length {len(header)} must be a multiple of {BLOCK}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | (_O_DIRECT if direct else 0), 0o644)
    try:
        if direct:
            _write_direct(fd, header, payload)
        else:
            _pwrite_all(fd, memoryview(header), 0)
            _pwrite_all(fd, payload, len(header))
            pad = padded_size(len(header), len(payload)) - len(header) - len(payload)
            _pwrite_all(fd, memoryview(bytes(pad)), len(header) + len(payload))
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def open_object(path: str, *, direct: bool) -> int:
    return os.open(path, os.O_RDONLY | (_O_DIRECT if direct else 0))


def read_head(fd: int) -> bytes:
    """The first block of an object file (enough for any header), shorter if the file is."""
    bounce = _bounce()[:BLOCK]
    n = os.preadv(fd, [bounce], 0)
    return bytes(bounce[:n])


def read_into(fd: int, offset: int, dst: memoryview, *, direct: bool) -> None:
    """Fill `dst` from the file at `offset`; CorruptObject if the file ends first."""
    if not direct:
        _pread_all(fd, dst, offset)
        return
    aligned = len(dst) - len(dst) % BLOCK
    if _address(dst) % BLOCK == 0:
        _pread_all(fd, dst[:aligned], offset)
    else:
        bounce = _bounce()
        for start in range(0, aligned, _BOUNCE_BYTES):
            piece = min(_BOUNCE_BYTES, aligned - start)
            _pread_all(fd, bounce[:piece], offset + start)
            dst[start : start + piece] = bounce[:piece]
    tail = len(dst) - aligned
    if tail:
        bounce = _bounce()[:BLOCK]
        if os.preadv(fd, [bounce], offset + aligned) < tail:
            raise CorruptObject("file ends inside the payload")
        dst[aligned:] = bounce[:tail]


def unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _write_direct(fd: int, header: bytes, payload: memoryview) -> None:
    bounce = _bounce()
    for start in range(0, len(header), _BOUNCE_BYTES):
        piece = header[start : start + _BOUNCE_BYTES]
        bounce[: len(piece)] = piece
        _pwrite_all(fd, bounce[: len(piece)], start)
    offset = len(header)
    aligned = len(payload) - len(payload) % BLOCK
    if _address(payload) % BLOCK == 0:
        _pwrite_all(fd, payload[:aligned], offset)
    else:
        for start in range(0, aligned, _BOUNCE_BYTES):
            size = min(_BOUNCE_BYTES, aligned - start)
            bounce[:size] = payload[start : start + size]
            _pwrite_all(fd, bounce[:size], offset + start)
    tail = len(payload) - aligned
    if tail:
        bounce[:tail] = payload[aligned:]
        bounce[tail:BLOCK] = bytes(BLOCK - tail)
        _pwrite_all(fd, bounce[:BLOCK], offset + aligned)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data = data[n:]
        offset += n


def _pread_all(fd: int, dst: memoryview, offset: int) -> None:
    while len(dst):
        n = os.preadv(fd, [dst], offset)
        if n == 0:
            raise CorruptObject("file ends inside the payload")
        dst = dst[n:]
        offset += n


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


def _bounce() -> memoryview:
    """A page-aligned scratch buffer owned by the calling thread (mmap memory is page-aligned)."""
    buffer = getattr(_local, "buffer", None)
    if buffer is None:
        buffer = _local.buffer = memoryview(mmap.mmap(-1, _BOUNCE_BYTES))
    return buffer

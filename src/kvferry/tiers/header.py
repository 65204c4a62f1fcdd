"""The on-tier object format: a small header followed by the tensor's raw bytes.

Layout (little-endian), shared by every tier so that any process can read what another wrote:

    body     magic "KVFO" | version u16 | header_len u16 | dtype u8 | ndim u8 | flags u16 |
             payload_len u64 | key_tag 16 B | shape ndim x u64
    checksum 16 B xxh3-128(body || payload), or xxh3-128(body) where flags has HEADER_ONLY
    padding  zeros up to header_len (the disk tier pads to 4096 so the payload starts block-aligned)
    payload  payload_len bytes

The checksum covers the body as well as the payload, so a flipped bit in the shape or dtype is caught too,
and the key tag (a hash of the key) catches an object stored under the wrong name. The checksum guards against
corruption (torn writes, bit rot, truncation), not against an adversary who can write the tier: xxh3-128 runs at
>10 GB/s on one core, where blake3 (~1.5-3 GB/s here) made verification slower than the disk (version 1).

A tier whose store already guarantees that a read returns the whole object as written (Mooncake Store) may write
objects whose checksum covers the header only (`encode_header(..., payload_checksum=False)`): summing the payload
is one more pass over memory, a third of the work where the copy itself is memory-bound. Readers verify whatever
an object carries, so writers with either setting share a store.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import blake3
import torch
import xxhash

MAGIC = b"KVFO"
FORMAT_VERSION = 2
CHECKSUM_BYTES = 16
KEY_TAG_BYTES = 16
MAX_NDIM = 8
KEY_NOTE = b"KEY:"  # starts the key written into a header's padding (`note_key`)
HEADER_ONLY = 0x1  # flags: the checksum covers the body, not the payload

_BODY = struct.Struct("<4sHHBBHQ16s")
MAX_HEADER_BYTES = _BODY.size + 8 * MAX_NDIM + CHECKSUM_BYTES

# Codes are part of the format: never renumber, only append.
_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float32: 3,
    torch.uint8: 4,
    torch.int8: 5,
    torch.float8_e4m3fn: 6,
    torch.float8_e5m2: 7,
    torch.float64: 8,
    torch.int16: 9,
    torch.int32: 10,
    torch.int64: 11,
}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


class CorruptObject(Exception):
    """A stored object failed verification; the tier treats it as a miss and deletes it."""


@dataclass(frozen=True)
class ObjectHeader:
    shape: tuple[int, ...]
    dtype: torch.dtype
    payload_len: int
    header_len: int
    body: bytes
    checksum: bytes
    payload_checksum: bool = True  # False: the checksum covers the body only (flags HEADER_ONLY)


def key_tag(key: bytes) -> bytes:
    return blake3.blake3(key).digest(KEY_TAG_BYTES)


def check_key(key: object) -> bytes:
    if not isinstance(key, bytes) or not key:
        raise TypeError(f"key must be non-empty bytes, got {type(key).__name__} {key!r:.40}")
    return key


def tensor_bytes(obj: object) -> memoryview:
    """A read-only byte view of a CPU tensor's storage (no copy); bf16 and fp8 go through a uint8 view."""
    if not isinstance(obj, torch.Tensor):
        raise TypeError(f"obj must be a torch.Tensor, got {type(obj).__name__}")
    if obj.device.type != "cpu":
        raise ValueError(f"obj must be a CPU tensor (host pool memory), got device {obj.device}")
    if obj.dtype not in _DTYPE_CODES:
        raise ValueError(f"obj.dtype={obj.dtype} is not storable; expected one of {sorted(map(str, _DTYPE_CODES))}")
    if not 1 <= obj.dim() <= MAX_NDIM:
        raise ValueError(f"obj.dim()={obj.dim()} must be between 1 and {MAX_NDIM}")
    if not obj.is_contiguous():
        raise ValueError(f"obj must be contiguous, got strides {obj.stride()} for shape {tuple(obj.shape)}")
    return obj.detach().reshape(-1).view(torch.uint8).numpy().data.toreadonly()


def destination_bytes(tensor: object, header: ObjectHeader) -> memoryview:
    """A writable byte view of the tensor `alloc` returned for `header`, checked to be what was asked for."""
    if (
        not isinstance(tensor, torch.Tensor)
        or tuple(tensor.shape) != header.shape
        or tensor.dtype != header.dtype
        or tensor.device.type != "cpu"
        or not tensor.is_contiguous()
    ):
        got = f"{tuple(tensor.shape)} {tensor.dtype} on {tensor.device}" if isinstance(tensor, torch.Tensor) else tensor
        raise ValueError(f"alloc({header.shape}, {header.dtype}) returned {got}; expected a contiguous CPU tensor")
    return tensor.detach().reshape(-1).view(torch.uint8).numpy().data


def encode_header(
    key: bytes, obj: torch.Tensor, payload: memoryview, *, align: int = 1, payload_checksum: bool = True
) -> bytes:
    """Header bytes for `obj` (whose bytes are `payload`), padded to a multiple of `align`; its checksum covers the
    payload unless `payload_checksum` is False."""
    shape = tuple(obj.shape)
    header_len = _round_up(_BODY.size + 8 * len(shape) + CHECKSUM_BYTES, align)
    flags = 0 if payload_checksum else HEADER_ONLY
    body = _BODY.pack(
        MAGIC, FORMAT_VERSION, header_len, _DTYPE_CODES[obj.dtype], len(shape), flags, len(payload), key_tag(key)
    ) + struct.pack(f"<{len(shape)}Q", *shape)
    hasher = xxhash.xxh3_128(body)
    if payload_checksum:
        hasher.update(payload)
    checksum = hasher.digest()
    return body + checksum + bytes(header_len - len(body) - CHECKSUM_BYTES)


def decode_header(key: bytes, data: bytes | bytearray | memoryview) -> ObjectHeader:
    """Parse and sanity-check a header (not yet the payload); raises CorruptObject naming what is wrong."""
    if len(data) < _BODY.size:
        raise CorruptObject(f"object is {len(data)} bytes, shorter than a header")
    magic, version, header_len, code, ndim, flags, payload_len, tag = _BODY.unpack_from(data)
    if magic != MAGIC:
        raise CorruptObject(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CorruptObject(f"format version {version}, this build reads {FORMAT_VERSION}")
    if code not in _CODE_DTYPES:
        raise CorruptObject(f"unknown dtype code {code}")
    if flags & ~HEADER_ONLY:
        raise CorruptObject(f"unknown flags {flags:#x}")
    if not 1 <= ndim <= MAX_NDIM:
        raise CorruptObject(f"ndim={ndim} out of range 1..{MAX_NDIM}")
    body_len = _BODY.size + 8 * ndim
    if header_len < body_len + CHECKSUM_BYTES or len(data) < body_len + CHECKSUM_BYTES:
        raise CorruptObject(f"header_len={header_len} too short for ndim={ndim} (have {len(data)} bytes)")
    if tag != key_tag(key):
        raise CorruptObject("key tag does not match the requested key")
    shape = struct.unpack_from(f"<{ndim}Q", data, _BODY.size)
    dtype = _CODE_DTYPES[code]
    expected = math.prod(shape) * dtype.itemsize
    if payload_len != expected:
        raise CorruptObject(f"payload_len={payload_len} but shape {shape} x {dtype} needs {expected}")
    return ObjectHeader(
        shape=tuple(shape),
        dtype=dtype,
        payload_len=payload_len,
        header_len=header_len,
        body=bytes(data[:body_len]),
        checksum=bytes(data[body_len : body_len + CHECKSUM_BYTES]),
        payload_checksum=not flags & HEADER_ONLY,
    )


def note_key(header: bytes, key: bytes) -> bytes:
    """``header`` with ``key`` itself written into its padding (``KEY_NOTE``, its length, the key), where the
    padding has room: the object then tells which key it holds (the key tag only checks a key one already
    has). Readers ignore padding, so this changes nothing for them."""
    at = _BODY.size + 8 * header[9] + CHECKSUM_BYTES  # byte 9: ndim
    note = KEY_NOTE + bytes([len(key)]) + key
    if len(key) > 255 or at + len(note) > len(header):
        return header
    return header[:at] + note + header[at + len(note) :]


def noted_key(head: bytes) -> bytes | None:
    """The key ``note_key`` wrote into a header (the first bytes of an object), checked against its key tag;
    None if there is none or it does not match."""
    if len(head) < _BODY.size:
        return None
    magic, version, _, _, ndim, _, _, tag = _BODY.unpack_from(head)
    at = _BODY.size + 8 * ndim + CHECKSUM_BYTES
    if magic != MAGIC or version != FORMAT_VERSION or head[at : at + len(KEY_NOTE)] != KEY_NOTE:
        return None
    start = at + len(KEY_NOTE) + 1
    key = bytes(head[start : start + head[start - 1]]) if len(head) > start else b""
    return key if key and key_tag(key) == tag else None


def verify_payload(header: ObjectHeader, payload: bytes | bytearray | memoryview) -> None:
    if len(payload) != header.payload_len:
        raise CorruptObject(f"payload is {len(payload)} bytes, header says {header.payload_len}")
    hasher = xxhash.xxh3_128(header.body)
    if header.payload_checksum:
        hasher.update(payload)
    if hasher.digest() != header.checksum:
        raise CorruptObject("checksum mismatch")


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align

"""KV events: what the cache reports as objects enter and leave each medium, and their wire format (vLLM's).

The records are engine-neutral: a chunk key (`kvferry.cache.keys`) is the block hash, the chunk size the block
size. ``encode_batch`` writes them as vLLM's ``KVEventBatch`` (``vllm.distributed.kv_events``, msgpack through
msgspec): a batch is the array ``[ts, [event, ...], data_parallel_rank]``; an event is a map tagged by its
``"type"``: ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``. vLLM's own
``msgspec.msgpack.Decoder(KVEventBatch)`` decodes what this writes; ``decode_batch`` reads it back without vLLM.

Media: ``CPU`` for the host pool, ``STORAGE`` for the tiers below it; ``locality`` ``LOCAL`` for the pool and a
disk tier, ``REMOTE`` for a tier other nodes share (Redis). ``ownership`` is always ``"kvferry"``. A store's
``BlockStored`` also carries ``kvferry_prefix``, `chain_digest` of every token before its first chunk (so a
follower names a chunk by its whole prefix, whether or not the chunks before it were stored in that key space), and
for a hybrid model's chunks ``kvferry_group``, the KV cache group of their key space (``CacheNamespace.group``):
fields vLLM's decoder skips.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
LOCAL = "LOCAL"
REMOTE = "REMOTE"
OWNERSHIP = "kvferry"
GROUP_FIELD = "kvferry_group"  # a BlockStored's key-space group (see the module)
PREFIX_FIELD = "kvferry_prefix"  # a BlockStored's chained digest of the tokens before it (see the module)
PREFIX_ROOT = b""  # the chained digest of no tokens


def chain_digest(previous: bytes, chunk_tokens: bytes) -> bytes:
    """The chained digest of a prefix one chunk longer: ``previous`` (of the tokens before; `PREFIX_ROOT` for
    none) and the chunk's token ids as little-endian uint32 bytes."""
    return hashlib.blake2b(previous + chunk_tokens, digest_size=16).digest()


def prefix_digests(token_bytes: bytes | memoryview, chunk_bytes: int, chunks: int) -> list[bytes]:
    """The chained digest of each whole-chunk prefix of ``token_bytes``: item ``i`` is that of its first ``i``
    chunks of ``chunk_bytes`` bytes, ``chunks + 1`` of them (item 0 `PREFIX_ROOT`)."""
    digests = [PREFIX_ROOT]
    for i in range(chunks):
        digests.append(chain_digest(digests[-1], bytes(token_bytes[i * chunk_bytes : (i + 1) * chunk_bytes])))
    return digests


@dataclass(frozen=True, slots=True)
class ChunksStored:
    """Consecutive chunks of one prefix now held in ``medium``: ``keys[0]``'s previous chunk is ``parent`` (None:
    chunk 0, or not known), ``tokens`` their token ids as little-endian uint32 bytes (empty where the medium keeps
    none: a promotion, a tier, a re-announcement); ``group``: the key space's KV cache group, where a store of a
    hybrid model's chunks made them; ``prefix``: `chain_digest` of the tokens before ``keys[0]``, where a store made
    them (None otherwise)."""

    keys: tuple[bytes, ...]
    parent: bytes | None
    tokens: bytes
    medium: str
    locality: str
    group: str | None = None
    prefix: bytes | None = None


@dataclass(frozen=True, slots=True)
class ChunksRemoved:
    """Chunks that left ``medium`` (each reported once per stay there)."""

    keys: tuple[bytes, ...]
    medium: str
    locality: str


@dataclass(frozen=True, slots=True)
class AllCleared:
    """Forget everything this stream said before: a re-announcement of what is held follows (after a start, or
    after events were dropped)."""


Record = ChunksStored | ChunksRemoved | AllCleared


def encode_batch(records: Sequence[Record], chunk_size: int, ts: float | None = None) -> bytes:
    """``records`` as one vLLM ``KVEventBatch`` (msgpack bytes); consecutive removals of one medium merge."""
    events: list[dict[str, Any]] = []
    for record in records:
        if isinstance(record, ChunksStored):
            tokens = np.frombuffer(record.tokens, dtype="<u4").tolist() if record.tokens else []
            stored = {
                "type": "BlockStored",
                "block_hashes": list(record.keys),
                "parent_block_hash": record.parent,
                "token_ids": tokens,
                "block_size": chunk_size,
                "lora_id": None,
                "medium": record.medium,
                "lora_name": None,
                "locality": record.locality,
                "ownership": OWNERSHIP,
            }
            if record.group is not None:
                stored[GROUP_FIELD] = record.group
            if record.prefix is not None:
                stored[PREFIX_FIELD] = record.prefix
            events.append(stored)
        elif isinstance(record, ChunksRemoved):
            last: dict[str, Any] = events[-1] if events else {"type": None}
            same = last["type"] == "BlockRemoved" and last["medium"] == record.medium
            if same and last["locality"] == record.locality:
                last["block_hashes"].extend(record.keys)
                continue
            events.append(
                {
                    "type": "BlockRemoved",
                    "block_hashes": list(record.keys),
                    "medium": record.medium,
                    "locality": record.locality,
                    "ownership": OWNERSHIP,
                }
            )
        else:
            events.append({"type": "AllBlocksCleared"})
    return msgpack.packb([time.time() if ts is None else ts, events, None], use_bin_type=True)


@dataclass(frozen=True, slots=True)
class DecodedBatch:
    ts: float
    records: list[Record]


def decode_batch(payload: bytes) -> DecodedBatch:
    """A ``KVEventBatch`` (from kvferry or vLLM) as records; ValueError naming what is wrong on bad input.
    ``tokens`` of a decoded store are its token ids packed as little-endian uint32 (ids outside uint32: empty)."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:
        raise ValueError(f"not a msgpack event batch: {exc}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError(f"an event batch is [ts, events, ...], got {type(batch).__name__}")
    ts = batch[0]
    if not isinstance(ts, int | float):
        raise ValueError(f"an event batch's ts must be a number, got {ts!r:.40}")
    return DecodedBatch(float(ts), [_record(event) for event in batch[1]])


def _record(event: object) -> Record:
    if not isinstance(event, dict):
        raise ValueError(f"an event is a map, got {type(event).__name__}")
    kind = event.get("type")
    if kind == "AllBlocksCleared":
        return AllCleared()
    if kind not in ("BlockStored", "BlockRemoved"):
        raise ValueError(f"unknown event type {kind!r:.40}")
    keys = tuple(_hash_bytes(h) for h in _list(event, "block_hashes"))
    medium = event.get("medium") or "GPU"  # vLLM's own events name none before 0.11
    locality = event.get("locality") or LOCAL
    if kind == "BlockRemoved":
        return ChunksRemoved(keys, medium, locality)
    parent = event.get("parent_block_hash")
    tokens = _list(event, "token_ids")
    packed = b""
    if tokens and all(isinstance(t, int) and 0 <= t < 2**32 for t in tokens):
        packed = np.asarray(tokens, dtype="<u4").tobytes()
    group, prefix = event.get(GROUP_FIELD), event.get(PREFIX_FIELD)
    if group is not None and not isinstance(group, str):
        raise ValueError(f"BlockStored.{GROUP_FIELD} must be a string, got {type(group).__name__}")
    if prefix is not None and not isinstance(prefix, bytes):
        raise ValueError(f"BlockStored.{PREFIX_FIELD} must be bytes, got {type(prefix).__name__}")
    parent_key = None if parent is None else _hash_bytes(parent)
    return ChunksStored(keys, parent_key, packed, medium, locality, group, prefix)


def _list(event: dict[str, Any], name: str) -> list[Any]:
    value = event.get(name)
    if not isinstance(value, list):
        raise ValueError(f"{event.get('type')}.{name} must be a list, got {type(value).__name__}")
    return value


def _hash_bytes(value: object) -> bytes:
    """A block hash as bytes: kvferry's keys are bytes; vLLM's may be ints (as 8 big-endian bytes, signed)."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return value.to_bytes(8, "big", signed=value < 0)
    raise ValueError(f"a block hash is bytes or an int, got {type(value).__name__}")

"""KV events on the wire: kvferry's records as vLLM's KVEventBatch, read back by vLLM's own decoder and ours."""

from __future__ import annotations

import importlib.util

import msgpack
import numpy as np
import pytest

from kvferry.cache.events import (
    LOCAL,
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    REMOTE,
    AllCleared,
    ChunksRemoved,
    ChunksStored,
    decode_batch,
    encode_batch,
)

CHUNK = 16


def _records(seed: int = 0) -> list[ChunksStored | ChunksRemoved | AllCleared]:
    rng = np.random.default_rng(seed)
    keys = [rng.bytes(32) for _ in range(5)]
    tokens = rng.integers(0, 2**32, size=3 * CHUNK, dtype=np.uint64).astype("<u4").tobytes()
    return [
        AllCleared(),
        ChunksStored(tuple(keys[:3]), keys[4], tokens, MEDIUM_CPU, LOCAL, "group=1:sliding_window:32", rng.bytes(16)),
        ChunksStored((keys[3],), keys[2], b"", MEDIUM_STORAGE, REMOTE),
        ChunksRemoved((keys[0],), MEDIUM_CPU, LOCAL),
        ChunksRemoved((keys[1], keys[4]), MEDIUM_CPU, LOCAL),
        ChunksRemoved((keys[3],), MEDIUM_STORAGE, REMOTE),
    ]


def test_round_trip_merges_consecutive_removals_of_one_medium() -> None:
    records = _records()
    decoded = decode_batch(encode_batch(records, CHUNK, ts=12.5))
    assert decoded.ts == 12.5
    expected = [*records[:3], ChunksRemoved(records[3].keys + records[4].keys, MEDIUM_CPU, LOCAL), records[5]]
    assert decoded.records == expected


def test_the_batch_is_vllms_array_of_tagged_maps() -> None:
    ts, events, dp_rank = msgpack.unpackb(encode_batch(_records(1), CHUNK, ts=1.0))
    assert (ts, dp_rank) == (1.0, None)
    assert [e["type"] for e in events] == [
        "AllBlocksCleared",
        "BlockStored",
        "BlockStored",
        "BlockRemoved",
        "BlockRemoved",
    ]
    stored = events[1]
    assert stored["block_size"] == CHUNK and len(stored["token_ids"]) == 3 * CHUNK
    assert stored["ownership"] == "kvferry" and stored["medium"] == "CPU"
    assert stored["kvferry_group"] == "group=1:sliding_window:32" and "kvferry_group" not in events[2]
    assert len(stored["kvferry_prefix"]) == 16 and "kvferry_prefix" not in events[2]


_BAD_GROUP = {"type": "BlockStored", "block_hashes": [], "token_ids": [], "kvferry_group": 1}
_BAD_PREFIX = {"type": "BlockStored", "block_hashes": [], "token_ids": [], "kvferry_prefix": "ab"}


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\x01",
        msgpack.packb({"a": 1}),
        msgpack.packb([1.0, [{"type": "X"}]]),
        msgpack.packb([1.0, [_BAD_GROUP]]),
        msgpack.packb([1.0, [_BAD_PREFIX]]),
    ],
)
def test_bad_batches_are_value_errors(payload: bytes) -> None:
    with pytest.raises(ValueError):
        decode_batch(payload)


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm")
def test_vllms_decoder_reads_kvferrys_batches() -> None:
    import msgspec
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    records = _records(2)
    batch = msgspec.msgpack.Decoder(KVEventBatch).decode(encode_batch(records, CHUNK, ts=3.0))
    assert batch.ts == 3.0
    cleared, stored, stored_tier, removed, removed_tier = batch.events
    assert isinstance(cleared, AllBlocksCleared)
    assert isinstance(stored, BlockStored) and isinstance(stored_tier, BlockStored)
    assert stored.block_hashes == list(records[1].keys)  # kvferry_group and kvferry_prefix skipped
    assert stored.token_ids == np.frombuffer(records[1].tokens, "<u4").tolist()
    assert (stored.block_size, stored.medium, stored.locality) == (CHUNK, "CPU", "LOCAL")
    assert (stored_tier.medium, stored_tier.locality, stored_tier.parent_block_hash) == (
        "STORAGE",
        "REMOTE",
        records[1].keys[2],
    )
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [*records[3].keys, *records[4].keys]
    assert isinstance(removed_tier, BlockRemoved) and removed_tier.medium == "STORAGE"

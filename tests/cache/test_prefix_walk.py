"""Finding the readable prefix by probing a few keys and walking parent links (index.readable_run), against the
plain chunk-by-chunk answer; the lock-free lookup re-checked under the lock; holes in a real engine."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.cache.index import READABLE, Entry, State, readable_run
from kvferry.cache.keys import CacheNamespace, ChunkHasher
from kvferry.formats.kinds import EngineKVFormat as F
from tests.cache.cachekit import CHUNK, NB, cache_engine, make_paged, random_blocks, random_tokens

NS = CacheNamespace("m", "bfloat16", "L")


@settings(max_examples=150, deadline=None)
@given(
    n_chunks=st.integers(0, 150),
    states=st.lists(st.sampled_from([None, *State]), max_size=150),
    start=st.integers(0, 160),
    algo=st.sampled_from(["sha256", "blake3"]),
)
def test_readable_run_matches_a_chunk_by_chunk_scan(
    n_chunks: int, states: list[State | None], start: int, algo: str
) -> None:
    # Mostly-resident chunks (with holes and unreadable states where `states` says) plus the entries of a
    # prompt that diverges in chunk 2: what a probe may land on must not change the answer.
    hasher = ChunkHasher(4, algo)
    tokens = np.random.default_rng(n_chunks).integers(0, 50_000, size=4 * n_chunks + 1).tolist()
    keys = hasher.keys(tokens, NS)
    other = [*tokens[:8], 50_001, *tokens[9:]]
    index: dict[bytes, Entry] = {}
    for keyset in (hasher.keys(other, NS), keys):
        for i, key in enumerate(keyset):
            state = states[i] if i < len(states) else State.RESIDENT
            if state is not None:
                index[key] = Entry(key, state, parent=keyset[i - 1] if i else None)
    expected = []
    for key in keys[start:]:
        entry = index.get(key)
        if entry is None or entry.state not in READABLE:
            break
        expected.append(entry)
    assert readable_run(index.get, hasher.prefix(tokens, NS), start) == expected


def test_lookup_and_retrieve_stop_at_a_hole_in_the_middle() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    src, dst = make_paged(fmt, NB, seed=1), make_paged(fmt, NB, seed=2)
    tokens = random_tokens(8 * CHUNK)
    with cache_engine(paged=src) as engine:
        engine.store(tokens, src, random_blocks(16, 1), fmt)
        assert engine.lookup(tokens) == 8 * CHUNK
        keys = engine.chunk_keys(tokens)
        with engine._res.lock:
            entry = engine._res.index.get(keys[5])
            assert entry is not None
            engine._res.detach_locked(entry)
        assert engine.lookup(tokens) == 5 * CHUNK
        assert engine.lookup(np.array(tokens)) == 5 * CHUNK
        assert engine.retrieve(tokens, dst, random_blocks(16, 2), fmt, skip_prefix_tokens=6 * CHUNK) == 2 * CHUNK
        assert engine.retrieve(tokens, dst, random_blocks(16, 2), fmt, skip_prefix_tokens=2 * CHUNK) == 3 * CHUNK
        # Storing again fills the hole, and its entry links back into the chain.
        assert engine.store(tokens, src, random_blocks(16, 1), fmt) == CHUNK
        assert engine.lookup(tokens) == 8 * CHUNK


def test_entries_found_without_the_lock_are_rechecked_once_something_left_the_index() -> None:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    src = make_paged(fmt, NB, seed=1)
    tokens = random_tokens(4 * CHUNK)
    with cache_engine(paged=src) as engine:
        engine.store(tokens, src, random_blocks(8, 1), fmt)
        res = engine._res
        removals = res.index.removals
        found = readable_run(res.index.get, engine._hasher.prefix(tokens, engine.namespace))
        assert len(found) == 4
        with res.lock:
            assert res.still_readable_locked(found, removals) is found  # nothing left: no per-entry check
            res.detach_locked(found[2])  # evicted between the walk and the lock
            assert res.still_readable_locked(found, removals) == found[:2]

"""8 threads storing and retrieving overlapping prefixes through one small engine for a bounded time.

Every retrieve is checked block by block against the source KV, and the engine verifies object checksums
before each copy: corruption shows as a mismatch or a checksum failure, a deadlock as a thread still alive
after the deadline, a leak as pool memory left after ``clear``.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from kvferry.cache import CacheEngine
from kvferry.cache.writer import ChunkWriter
from kvferry.config import KvferryConfig
from kvferry.formats.kinds import EngineKVFormat as F
from kvferry.memory import HostPool
from tests.cache.cachekit import CHUNK, PER_CHUNK, AheadCopies, block_contents, make_paged

FMT = F.NL_X_TWO_NB_BS_NH_HS
FAMILIES, CHUNKS, SHARED = 4, 6, 2  # 4 prompts of 6 chunks; the first 2 chunks are common to all
NB_SRC = FAMILIES * CHUNKS * PER_CHUNK
NB_DST = CHUNKS * PER_CHUNK + 4
RUN_S = 2.0


def _source_blocks(family: int) -> list[int]:
    """Source blocks of each family's chunks: shared chunks map to family 0's blocks (same tokens, same KV)."""
    ids = []
    for chunk in range(CHUNKS):
        owner = 0 if chunk < SHARED else family
        base = (owner * CHUNKS + chunk) * PER_CHUNK
        ids.extend(range(base, base + PER_CHUNK))
    return ids


@pytest.mark.parametrize(("policy", "ahead"), [("lru", False), ("s3fifo", False), ("lru", True)])
def test_eight_threads_overlapping_prefixes_no_corruption_no_deadlock(
    policy: str, ahead: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ahead`: stores copy before they index (the GPU path's order), their copies landing only when waited for."""
    if ahead:
        AheadCopies(monkeypatch)
        monkeypatch.setattr(ChunkWriter, "AHEAD_PAUSE", 0)  # ahead every time, present chunks or not
    rng = np.random.default_rng(0)
    common = rng.integers(0, 32_000, size=SHARED * CHUNK).tolist()
    prompts = [common + rng.integers(0, 32_000, size=(CHUNKS - SHARED) * CHUNK).tolist() for _ in range(FAMILIES)]
    src = make_paged(FMT, NB_SRC, seed=1)
    expected = [[block_contents(src, FMT, b) for b in _source_blocks(f)] for f in range(FAMILIES)]
    # Room for 10 of the 18 distinct chunks: eviction runs all the time, LRU and lock paths included.
    config = KvferryConfig.load(
        env={},
        overrides={
            "cache": {"chunk_size": CHUNK, "verify_checksums": True, "eviction_batch": 2, "eviction_policy": policy}
        },
    )
    engine = CacheEngine(config, pool=HostPool(10 * 4096, pin=False))
    engine.namespace = engine.namespace_for("concurrency", FMT, src)
    errors: list[BaseException] = []
    counts = [0] * 8
    deadline = time.monotonic() + RUN_S

    def worker(index: int) -> None:
        chooser = random.Random(index)
        dst: Any = make_paged(FMT, NB_DST, seed=100 + index)
        try:
            while time.monotonic() < deadline:
                family = chooser.randrange(FAMILIES)
                n_tokens = chooser.randrange(1, CHUNKS + 1) * CHUNK + chooser.randrange(CHUNK)
                tokens = prompts[family][:n_tokens]
                op = chooser.random()
                if op < 0.4:
                    engine.store(tokens, src, _source_blocks(family)[: -(-n_tokens // 16)], FMT)
                    continue
                dst_ids = chooser.sample(range(NB_DST), -(-n_tokens // 16))
                lock_id = None
                if op < 0.7:
                    lock_id = engine.lookup_status(tokens, lock=True).lock_id
                got = engine.retrieve(tokens, dst, dst_ids, FMT, lock_id=lock_id)
                assert got % CHUNK == 0 and got <= n_tokens
                for i in range(got // 16):
                    actual = block_contents(dst, FMT, dst_ids[i])
                    assert torch.equal(actual, expected[family][i]), f"family {family} block {i} corrupt"
                counts[index] += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=RUN_S + 30)
    assert not any(t.is_alive() for t in threads), "a worker is stuck: deadlock"
    if errors:
        raise errors[0]
    stats = engine.stats()
    assert stats["checksum_failures"] == 0
    assert sum(counts) > 50 and stats["retrieved_chunks"] > 0 and stats["evictions"] > 0
    assert stats["locks"] == 0  # every lookup lock ended with its retrieve
    engine.clear()
    assert engine.pool.used_bytes == 0 and engine.pool.num_allocations == 0
    engine.close()

"""Tail objects (kvferry.cache.tails): a store's partial last chunk, hit at block granularity by a longer prompt,
never when its tokens differ; superseded tails evicted first; tails kept out of tiers."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from kvferry.cache import CacheEngine
from kvferry.config import KvferryConfig
from kvferry.formats.kinds import EngineKVFormat as F
from kvferry.memory import HostPool
from tests.cache.cachekit import BS, NB, assert_blocks_equal, make_paged, random_blocks, random_tokens

CHUNK = 64  # 4 blocks of 16: tails of 1, 2 or 3 blocks
FMT = F.NL_X_TWO_NB_BS_NH_HS


def _engine(paged: Any, fmt: F = FMT, pool_bytes: int = 1 << 20, tiers: list[str] | None = None, **cache: Any) -> Any:
    config = KvferryConfig.load(env={}, overrides={"cache": {"chunk_size": CHUNK, **cache}, "tiers": tiers or []})
    engine = CacheEngine(config, pool=HostPool(pool_bytes, alignment=256, pin=False))
    engine.namespace = engine.namespace_for("tails", fmt, paged, block_size=BS if "NBBS" in fmt.name else None)
    return engine


@pytest.mark.parametrize("fmt", [FMT, F.NB_NL_TWO_BS_NH_HS, F.TWO_X_NL_X_NBBS_NH_HS], ids=lambda f: f.name)
def test_a_longer_prompt_hits_the_stored_tail_and_loads_it_bit_exact(fmt: F) -> None:
    src, dst = make_paged(fmt, NB, seed=1), make_paged(fmt, NB, seed=2)
    turn1 = random_tokens(2 * CHUNK + 45)  # 2 chunks + 45 tokens: a tail of 2 whole blocks (32 tokens)
    src_ids, dst_ids = random_blocks(11, 3), random_blocks(11, 4)
    with _engine(src, fmt) as engine:
        bs = {"block_size": BS} if "NBBS" in fmt.name else {}
        assert engine.store(turn1, src, src_ids, fmt, tail=True, **bs) == 2 * CHUNK + 32
        assert engine.stats()["stored_tail_tokens"] == 32
        turn2 = turn1[: 2 * CHUNK + 45] + random_tokens(300, seed=5)  # the next turn goes on from the whole of turn 1
        assert engine.lookup(turn2) == 2 * CHUNK + 32
        assert engine.lookup(turn2, block_size=32) == 2 * CHUNK + 32
        assert engine.lookup(turn2, block_size=64) == 2 * CHUNK  # a tail is never cut: 32 is not whole 64s
        hit = turn2[: 2 * CHUNK + 32]
        assert engine.retrieve(hit, dst, dst_ids, fmt, **bs) == 2 * CHUNK + 32
        assert_blocks_equal(src, src_ids[:10], dst, dst_ids[:10], fmt)
        # A skip inside the tail: only the tail's blocks after it are written.
        other = make_paged(fmt, NB, seed=6)
        assert engine.retrieve(hit, other, dst_ids, fmt, skip_prefix_tokens=2 * CHUNK + BS, **bs) == BS
        assert_blocks_equal(src, src_ids[9:10], other, dst_ids[9:10], fmt)


def test_a_tail_whose_tokens_differ_or_do_not_fit_is_never_a_hit() -> None:
    paged = make_paged(FMT, NB)
    turn1 = random_tokens(CHUNK + 60)  # 1 chunk + a 48-token tail
    with _engine(paged) as engine:
        assert engine.store(turn1, paged, list(range(8)), FMT, tail=True) == CHUNK + 48
        changed = [*turn1[: CHUNK + 47], turn1[CHUNK + 47] + 1, *random_tokens(100, seed=1)]  # its last tail token
        assert engine.lookup(changed) == CHUNK
        assert engine.lookup(turn1[: CHUNK + 47]) == CHUNK  # shorter than the tail: it does not fit
        assert engine.lookup(turn1[: CHUNK + 48]) == CHUNK + 48
        assert engine.lookup(random_tokens(CHUNK + 60, seed=9)) == 0
        # A retrieve never copies a tail it cannot use whole: the chunk only.
        assert engine.retrieve(turn1[: CHUNK + 40], paged, list(range(8, 16)), FMT) == CHUNK


def test_a_prompt_shorter_than_a_chunk_is_a_tail_too() -> None:
    paged = make_paged(FMT, NB)
    short = random_tokens(40)
    with _engine(paged) as engine:
        assert engine.store(short, paged, [5, 6], FMT) == 0  # tails only when asked for
        assert engine.store(short, paged, [5, 6], FMT, tail=True) == 32
        assert engine.lookup([*short, 1, 2, 3]) == 32
        assert engine.retrieve(short, paged, [7, 8], FMT) == 32
        assert_blocks_equal(paged, [5, 6], paged, [7, 8], FMT)


def test_a_tail_after_chunks_an_earlier_store_still_writes_is_kept() -> None:
    """A request's store at its finish (its chunks skipped: an earlier store of it wrote them) may run before that
    earlier store, on another worker thread: its tail is kept, and hit once the chunks land."""
    src, dst = make_paged(FMT, NB, seed=1), make_paged(FMT, NB, seed=2)
    turn = random_tokens(2 * CHUNK + 40)  # a tail of 2 whole blocks
    ids = random_blocks(11, 7)
    with _engine(src) as engine:
        assert engine.store(turn, src, ids, FMT, skip_prefix_tokens=2 * CHUNK, tail=True) == 32
        assert engine.lookup(turn) == 0  # its chunks are not there yet
        assert engine.store(turn[: 2 * CHUNK], src, ids, FMT) == 2 * CHUNK
        assert engine.lookup(turn) == 2 * CHUNK + 32
        assert engine.retrieve(turn, dst, ids, FMT) == 2 * CHUNK + 32
        assert_blocks_equal(src, ids[:10], dst, ids[:10], FMT)


def test_a_superseded_tail_is_evicted_first() -> None:
    paged = make_paged(FMT, NB)
    convo = random_tokens(4 * CHUNK)
    with _engine(paged) as engine:
        policy = engine._res.policy
        engine.store(convo[: CHUNK + 16], paged, list(range(16)), FMT, tail=True)  # tail of 16
        short_tail = next(key for key in policy._order if engine._res.index.get(key).tail == 16)
        assert next(iter(policy._order)) != short_tail  # the oldest is chunk 0
        engine.store(convo[: CHUNK + 48], paged, list(range(16)), FMT, tail=True)  # a longer tail of 48
        assert next(iter(policy._order)) == short_tail
        long_tail = next(key for key in policy._order if engine._res.index.get(key).tail == 48)
        engine.store(convo[: 3 * CHUNK], paged, list(range(16)), FMT, tail=True)  # the full chunk after both
        assert set(list(policy._order)[:2]) == {long_tail, short_tail}
        assert engine.lookup(convo) == 3 * CHUNK
        assert engine.lookup(convo[: CHUNK + 48]) == CHUNK + 48  # until evicted, a repeat still reads it


def test_tails_stay_in_the_pool_and_cost_only_their_tokens(tmp_path: Path) -> None:
    paged = make_paged(FMT, NB)
    per_token = 2 * 2 * 2 * 8 * 2  # K and V, 2 layers, 2 heads of 8, fp16
    with _engine(paged, tiers=[f"disk:{tmp_path}?size=1MB"], tier_write="on_store") as engine:
        tokens = random_tokens(2 * CHUNK + 20)
        assert engine.store(tokens, paged, list(range(10)), FMT, tail=True) == 2 * CHUNK + 16
        assert engine.pool.used_bytes == (2 * CHUNK + 16) * per_token
        deadline = time.monotonic() + 10
        while not all(engine.tiers[0].contains_many(engine.chunk_keys(tokens))) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # a tail's write, were there one, was submitted with the chunks'
        assert len(list(tmp_path.rglob("*.kvf"))) == 2  # the chunks only
        engine.clear()
        assert engine.lookup(tokens) == 0
        assert engine.prefetch(tokens).result(timeout=10) == 2 * CHUNK  # chunks come back from the tier; no tail

"""A retrieve of pages (`CacheEngine.retrieve_steps(..., pages=True)`): each chunk of the tokens a page keyed as a
one-chunk prefix of its own, as an engine that keys pages by a hash of all before them stores them one at a time;
the leading pages the cache holds load in one copy, each into its chunk's blocks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.cache import CacheNamespace
from kvferry.cache.keys import _PAGE_KEYS_KEPT, ChunkHasher
from kvferry.formats.kinds import EngineKVFormat as F
from tests.cache.cachekit import (
    BS,
    CHUNK,
    NB,
    assert_blocks_equal,
    block_contents,
    cache_engine,
    make_paged,
    random_blocks,
    random_tokens,
)

FMT = F.NL_X_TWO_NB_BS_NH_HS
PER = CHUNK // BS  # engine blocks a page


def _pages(count: int, seed: int) -> list[list[int]]:
    return [random_tokens(CHUNK, seed=seed + i) for i in range(count)]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**31 - 1), min_size=4, max_size=4), min_size=1, max_size=6))
def test_a_page_key_is_the_key_its_tokens_have_alone(pages: list[list[int]]) -> None:
    hasher, ns = ChunkHasher(4), CacheNamespace("m", "float16", "L", 1, 0)
    keys = hasher.pages([t for page in pages for t in page], ns)
    assert keys.n == len(pages)
    assert keys.keys() == [hasher.keys(page, ns)[0] for page in pages]
    assert keys.keys(1) == keys.keys()[1:] and keys.key(len(pages) - 1) == keys.keys()[-1]


def test_a_remembered_page_key_is_its_namespaces_and_stays_so_once_forgotten() -> None:
    hasher = ChunkHasher(4)
    one, other = CacheNamespace("m", "float16", "L", 1, 0), CacheNamespace("m", "float16", "L", 2, 0)
    page = [5, 6, 7, 8]
    first = hasher.pages(page, one).key(0)
    assert hasher.pages(page, other).key(0) not in (first, hasher.pages(page, one).key(0))
    assert hasher.pages(page, one).key(0) == first == hasher.keys(page, one)[0]
    many = [t for i in range(_PAGE_KEYS_KEPT + 1) for t in (i, i + 1, i + 2, i + 3)]  # more pages than it keeps
    hasher.pages(many, other).keys()
    assert hasher.pages(page, one).key(0) == first


def test_the_leading_pages_held_load_in_one_retrieve_each_into_its_blocks() -> None:
    src, dst = make_paged(FMT, NB, seed=1), make_paged(FMT, NB, seed=2)
    pages = _pages(5, seed=10)
    src_ids, dst_ids = random_blocks(5 * PER, seed=3), random_blocks(5 * PER, seed=4)
    with cache_engine(paged=src) as engine:
        for i in (0, 1, 3, 4):  # stored one page at a time, each a one-chunk prefix; page 2 never
            assert engine.store(pages[i], src, src_ids[i * PER : (i + 1) * PER], FMT) == CHUNK
        before = [block_contents(dst, FMT, b).clone() for b in dst_ids]
        retrieves = engine.stats()["retrieves"]
        tokens = [t for page in pages for t in page]
        assert engine.retrieve(tokens, dst, dst_ids, FMT, pages=True) == 2 * CHUNK  # pages 0 and 1: page 2 missing
        assert engine.stats()["retrieves"] == retrieves + 1
        assert_blocks_equal(src, src_ids[: 2 * PER], dst, dst_ids[: 2 * PER], FMT)
        for block, old in zip(dst_ids[2 * PER :], before[2 * PER :], strict=True):
            assert torch.equal(block_contents(dst, FMT, block), old)  # nothing after the first missing page
        held = [pages[i] for i in (3, 4, 0)]  # any order: each page is found alone
        order = [src_ids[i * PER : (i + 1) * PER] for i in (3, 4, 0)]
        assert engine.retrieve([t for p in held for t in p], dst, dst_ids[: 3 * PER], FMT, pages=True) == 3 * CHUNK
        assert_blocks_equal(src, [b for ids in order for b in ids], dst, dst_ids[: 3 * PER], FMT)
        # The same tokens as one prefix: its first chunk is the first page alone, the others are keys of their own.
        assert engine.retrieve([t for p in held for t in p], dst, dst_ids[: 3 * PER], FMT) == CHUNK


def test_pages_are_loaded_whole() -> None:
    src = make_paged(FMT, NB, seed=1)
    with cache_engine(paged=src) as engine, pytest.raises(ValueError, match="a retrieve of pages loads each"):
        engine.retrieve(_pages(2, seed=1)[0] * 2, src, random_blocks(2 * PER, seed=5), FMT, skip_prefix_tokens=CHUNK,
                        pages=True)  # fmt: skip


def test_pages_stored_in_one_store_are_the_pages_stored_alone() -> None:
    src, dst = make_paged(FMT, NB, seed=1), make_paged(FMT, NB, seed=2)
    pages = _pages(4, seed=20)
    src_ids, dst_ids = random_blocks(4 * PER, seed=5), random_blocks(4 * PER, seed=6)
    tokens = [t for page in pages for t in page]
    with cache_engine(paged=src) as engine:
        stores = engine.stats()["stores"]
        assert engine.store(tokens[: 3 * CHUNK], src, src_ids[: 3 * PER], FMT, pages=True) == 3 * CHUNK
        assert engine.stats()["stores"] == stores + 1
        assert [engine.lookup(page) for page in pages] == [CHUNK, CHUNK, CHUNK, 0]  # each a one-chunk prefix
        assert engine.lookup(tokens) == CHUNK  # as one prefix, only its first chunk is a page's key
        # Stored again with a new page after them: only that one is new.
        assert engine.store(tokens, src, src_ids, FMT, pages=True) == CHUNK
        assert engine.retrieve(tokens, dst, dst_ids, FMT, pages=True) == 4 * CHUNK
        assert_blocks_equal(src, src_ids, dst, dst_ids, FMT)
        with pytest.raises(ValueError, match="a store of pages stores each of them"):
            engine.store(tokens, src, src_ids, FMT, pages=True, tail=True)

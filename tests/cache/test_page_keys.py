"""Pages keyed by a 32-byte hash of the engine's own (`kvferry.cache.page_keys`): the tokens each is stored under,
made only when read, and keys that cannot be pages refused."""

from __future__ import annotations

import numpy as np
import pytest

from kvferry.cache.page_keys import KEY_TOKENS, KeyedPages, key_rows


def test_a_pages_tokens_spell_its_key_in_31_bit_words_then_zeros() -> None:
    raw = bytes(range(32)) + b"\xff" * 32
    rows = key_rows(raw, 12)
    assert rows.shape == (2, 12) and rows.dtype == np.dtype("<u4")
    assert rows[0, :KEY_TOKENS].tolist() == [int.from_bytes(raw[i : i + 4], "little") for i in range(0, 32, 4)]
    assert rows[1, :KEY_TOKENS].tolist() == [0x7FFFFFFF] * KEY_TOKENS  # the top bit of each word cleared
    assert not rows[:, KEY_TOKENS:].any()


def test_keyed_pages_make_their_tokens_when_first_read() -> None:
    raw = np.random.default_rng(3).bytes(3 * 32)
    pages = KeyedPages.received(raw, 16)
    assert len(pages) == 48 and pages._array is None  # a store reads only the count before its copy
    assert np.array_equal(np.asarray(pages), key_rows(raw, 16).reshape(-1))
    assert pages[16 + 2] == key_rows(raw, 16)[1, 2] and pages.raw_keys() == raw


@pytest.mark.parametrize(("raw", "page_size", "match"), [
    (b"\1" * 33, 16, "32 bytes each, got 33"),
    (b"\1" * 32, KEY_TOKENS - 1, "a page of 7 tokens cannot spell"),
])  # fmt: skip
def test_keys_that_cannot_be_pages_are_refused(raw: bytes, page_size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KeyedPages.received(raw, page_size)
    with pytest.raises(ValueError, match=match):
        key_rows(raw, page_size)

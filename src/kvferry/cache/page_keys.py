"""Pages an engine keys by a hash of its own (SGLang's page hashes) rather than by their tokens.

The cache keys a chunk by a hash of its token prefix (`kvferry.cache.keys`). An engine that hands over pages keyed
by a 32-byte hash chained over the pages before them stores each page as a one-chunk prefix of its own whose tokens
spell that key: its 32 bytes as 8 little-endian words of 31 bits, then zeros to the page size (`key_rows`). Those
tokens are made when the cache first reads them (`KeyedPages`): a store reads only their count before its copy is
enqueued. A client sends a server the keys themselves (2 KiB for 64 pages, rather than their tokens' 16 KiB of
mostly zeros, made and packed on the engine's path to its copy), and the server makes the same tokens from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

KEY_BYTES = 32
KEY_TOKENS = KEY_BYTES // 4  # a page's key as token ids: 8 words of 31 bits (248 bits)


def key_rows(raw: bytes | memoryview, page_size: int) -> np.ndarray:
    """The token ids each page of ``raw`` (its pages' 32-byte keys, back to back) is stored under, a row a page."""
    pages = _pages(raw, page_size)
    rows = np.zeros((pages, page_size), dtype="<u4")
    rows[:, :KEY_TOKENS] = np.frombuffer(raw, dtype="<u4").reshape(pages, KEY_TOKENS) & 0x7FFFFFFF
    return rows


def _pages(raw: bytes | memoryview, page_size: int) -> int:
    """How many pages ``raw`` keys; ValueError where it is no whole number of keys or a page is too short."""
    if len(raw) % KEY_BYTES:
        raise ValueError(f"page keys are {KEY_BYTES} bytes each, got {len(raw)} bytes")
    if page_size < KEY_TOKENS:
        raise ValueError(f"a page of {page_size} tokens cannot spell a {KEY_BYTES}-byte key ({KEY_TOKENS} tokens)")
    return len(raw) // KEY_BYTES


class KeyedPages(Sequence[int]):
    """The tokens of ``pages`` pages of ``page_size`` tokens stored under their keys (`key_rows`, flattened), made
    when first read (numpy's array protocol: the cache reads tokens with `np.asarray`). A subclass may make its keys
    when first asked for them (`raw_keys`) and its rows its own way (`rows`), to the same tokens."""

    __slots__ = ("_array", "_raw", "page_size", "pages")

    def __init__(self, raw: bytes | None, pages: int, page_size: int) -> None:
        self._raw, self.pages, self.page_size = raw, pages, page_size
        self._array: np.ndarray | None = None

    @classmethod
    def received(cls, raw: bytes, page_size: int) -> KeyedPages:
        """Pages whose keys came as ``raw``; ValueError where it is no whole number of keys or a page too short."""
        return cls(raw, _pages(raw, page_size), page_size)

    def raw_keys(self) -> bytes:
        """The pages' 32-byte keys, back to back."""
        assert self._raw is not None
        return self._raw

    def rows(self) -> np.ndarray:
        return key_rows(self.raw_keys(), self.page_size)

    def __len__(self) -> int:
        return self.pages * self.page_size

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if self._array is None:
            self._array = self.rows().reshape(-1)
        return self._array if dtype is None else self._array.astype(dtype)

    def __getitem__(self, index: Any) -> Any:
        return self.__array__()[index]

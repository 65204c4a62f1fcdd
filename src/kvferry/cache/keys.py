"""Cache keys: token ids cut into chunks, each chunk keyed by a hash of the whole prefix up to its end.

``key_i = H_ns(tokens of chunks 0..i)``: one streaming hash over the prompt, read out at every chunk boundary.
``H_ns`` is blake3 keyed with the namespace digest (the default), or sha256 over ``namespace digest || token
bytes``, so a key identifies the namespace and every token before the end of its chunk: two prompts share exactly
the keys of the chunks before their first differing token. Token ids are hashed as little-endian uint32, so keys
are the same in every process and on every machine (never Python's ``hash``, which is salted per process). Both
hashes are cryptographic: a tenant who controls its tokens cannot make its chunk collide with another tenant's.

Why a prefix hash rather than the earlier chain ``H(key_{i-1} || chunk i)`` (schema v1): the key of chunk ``m``
needs no other key, only the bytes before it, so ``PrefixKeys.key(m)`` is one bulk hash call instead of ``m``
calls of ~1.5 us of interpreter overhead each. A lookup probes a few such keys and follows the index's parent
links (see ``kvferry.cache.index.readable_run``) instead of hashing every chunk. Why blake3 by default: in bulk it
hashes 8 chunks at once with SIMD (512 KiB in ~0.15-0.2 ms here, sha256 ~0.35 ms even with SHA-NI); read out
chunk by chunk (a store's new chunks) it costs ~2 us per key against sha256's ~1.2 us.

Tails: the tokens after a prompt's last full chunk may be stored as a tail object (``store(..., tail=True)``,
see ``kvferry.cache.tails``), keyed the same way: ``H_ns(tokens 0 .. end of the tail)``, the stream read out at the
tail's last token. A tail's key input is never a whole number of chunks, so it never equals a chunk's key, and it
stays a function of the token prefix alone (every engine and tensor-parallel size shares it).
"""

from __future__ import annotations

import array
import functools
import hashlib
import json
import sys
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import blake3
import numpy as np
import torch

TokenIds = Sequence[int] | np.ndarray | torch.Tensor
_U32_LE = np.dtype("<u4")
KEY_BYTES = 32
_KEY_SCHEMA = "kvferry-cache-key-v2"  # v2: prefix hash (v1 chained H(key_{i-1} || chunk i))
# Chunks between the hash states a PrefixKeys keeps: a probe behind the furthest hashed point re-hashes at most
# this many chunks (64 KiB at 256 tokens), and a state copy costs less than 1 us.
_CHECKPOINT = 64
_PAGE_KEYS_KEPT = 8192  # pages whose keys a `ChunkHasher` remembers (~4 MiB of 64-token pages)


class _Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...
    def digest(self) -> bytes: ...
    def copy(self) -> _Hasher: ...


@dataclass(frozen=True)
class CacheNamespace:
    """Everything that must match for two processes to share KV objects: the key space of one deployment.

    ``layout`` names the object layout (engine format and object shape); ``salt`` separates deployments (or
    tenants) that would otherwise share. The digest seeds every key, so different namespaces never collide.

    The rest names the KV within a deployment, each a field of its own: ``codec``, the chunk objects' codec
    (`kvferry.formats.CODECS`); ``kv_cache_dtype``, the engine's cache dtype where the tensors' dtype does not name
    it (fp8 of either encoding is held in uint8 tensors; None where it would be ``kv_dtype``); ``group``, a hybrid
    model's KV cache group (`kvferry.connector.kv_groups.KVGroup.tag`); ``split``, a part of a layer split
    (`kvferry.formats.layer_split.LayerSplit.tag`). `key_input` hashes every field.
    """

    model: str
    kv_dtype: str
    layout: str
    world_size: int = 1
    rank: int = 0
    salt: str = ""
    codec: str = "none"  # each codec is its own key space
    kv_cache_dtype: str | None = field(default=None, kw_only=True)
    group: str | None = field(default=None, kw_only=True)
    split: str | None = field(default=None, kw_only=True)
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("model", "kv_dtype", "layout", "codec"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"CacheNamespace.{name}={value!r} must be a non-empty string")
        if not isinstance(self.salt, str):
            raise TypeError(f"CacheNamespace.salt={self.salt!r} must be a string")
        for name in ("kv_cache_dtype", "group", "split"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value or "|" in value):
                raise ValueError(f"CacheNamespace.{name}={value!r} must be None or a non-empty string without '|'")
        if not _is_int(self.world_size) or self.world_size < 1:
            raise ValueError(f"CacheNamespace.world_size={self.world_size!r} must be an int >= 1")
        if not _is_int(self.rank) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"CacheNamespace.rank={self.rank!r} must be an int in [0, {self.world_size})")
        if self.kv_cache_dtype == self.kv_dtype:  # one spelling of one key space
            object.__setattr__(self, "kv_cache_dtype", None)
        object.__setattr__(self, "digest", hashlib.sha256(key_input(self)).digest())


def key_input(namespace: CacheNamespace) -> bytes:
    """The bytes a namespace's digest hashes: every field of it.

    Before ``kv_cache_dtype``, ``group`` and ``split`` were fields, the connector appended them to the salt
    (``salt|group|split|kv_cache_dtype=...``, each where set), and a codec other than ``none`` was appended to the
    list: they are rendered the same way here, so keys that disk and Redis tiers hold from then still hit. No
    typed field may hold a ``|``, so a rendered salt names one set of them (a deployment's own salt aside)."""
    salt = namespace.salt
    for tag in (namespace.group, namespace.split):
        if tag is not None:
            salt = f"{salt}|{tag}"
    if namespace.kv_cache_dtype is not None:
        salt = f"{salt}|kv_cache_dtype={namespace.kv_cache_dtype}"
    fields = [_KEY_SCHEMA, namespace.model, namespace.kv_dtype, namespace.layout, namespace.world_size]
    fields += [namespace.rank, salt]
    if namespace.codec != "none":  # exact objects keep the keys they always had
        fields.append(namespace.codec)
    return json.dumps(fields, separators=(",", ":")).encode()


class PrefixKeys:
    """The chunk keys of one token sequence, computed on demand: ``key(m)`` hashes forward from the nearest
    state already reached, so probing a few keys costs about one pass over the tokens. Not thread-safe."""

    __slots__ = ("_data", "_positions", "_states", "_step", "n")

    def __init__(self, data: memoryview, step: int, seed: _Hasher) -> None:
        self.n = len(data) // step  # full chunks
        self._data = data
        self._step = step
        self._positions = [0]  # chunks hashed by each saved state, ascending
        self._states = [seed]  # never updated once saved: callers get copies

    def key(self, m: int) -> bytes:
        """Key of chunk ``m`` (0 <= m < n)."""
        if not 0 <= m < self.n:
            raise IndexError(f"chunk {m} out of range [0, {self.n})")
        return self._state_at(m + 1).digest()

    @property
    def chunk_size(self) -> int:
        return self._step // 4

    def tail_key(self, m: int, length: int) -> bytes:
        """Key of the tail of ``length`` tokens (0 < length < chunk size) after the first ``m`` full chunks."""
        start = m * self._step
        end = start + length * 4
        if not 0 <= m <= self.n or not 0 < length * 4 < self._step or end > len(self._data):
            raise IndexError(f"tail of {length} tokens after chunk {m} is out of range")
        h = self._state_at(m)
        h.update(self._data[start:end])
        return h.digest()

    def keys(self, first: int = 0) -> list[bytes]:
        """Keys of chunks ``first .. n-1``: a bulk hash up to ``first``, then one update and digest per chunk."""
        if first >= self.n:
            return []
        h = self._states[0].copy() if first == 0 else self._state_at(first)  # a store from token 0: no search
        update, digest = h.update, h.digest
        data, step = self._data, self._step
        out = []
        for start in range(first * step, self.n * step, step):
            update(data[start : start + step])  # slices of a memoryview copy nothing
            out.append(digest())  # digest() leaves the state as it was: the stream goes on
        return out

    def _state_at(self, end: int) -> _Hasher:
        """A fresh hasher that has hashed chunks ``0 .. end-1``; saves the states it passes on the way."""
        i = bisect_right(self._positions, end) - 1
        pos = self._positions[i]
        h = self._states[i].copy()
        new_positions: list[int] = []
        new_states: list[_Hasher] = []
        while pos < end:
            stop = min(end, (pos // _CHECKPOINT + 1) * _CHECKPOINT)
            h.update(self._data[pos * self._step : stop * self._step])
            pos = stop
            new_positions.append(pos)
            new_states.append(h.copy())
        # Everything passed lies between positions[i] and positions[i + 1]: splice it in, order kept.
        self._positions[i + 1 : i + 1] = new_positions
        self._states[i + 1 : i + 1] = new_states
        return h


class PageKeys:
    """The keys of a sequence of pages: each chunk of the tokens a one-chunk prefix of its own (a page that an engine
    keys by a hash of everything before it, as SGLang does), so chunk ``m``'s key is the key its tokens have alone.
    The `PrefixKeys` interface a retrieve reads keys through."""

    __slots__ = ("_data", "_key_of", "_step", "n")

    def __init__(self, data: memoryview, step: int, key_of: Callable[[bytes], bytes]) -> None:
        self.n = len(data) // step
        self._data = data
        self._step = step
        self._key_of = key_of  # a page's bytes -> its key

    def key(self, m: int) -> bytes:
        if not 0 <= m < self.n:
            raise IndexError(f"page {m} out of range [0, {self.n})")
        return self._key_of(self._data[m * self._step : (m + 1) * self._step].tobytes())

    def keys(self, first: int = 0) -> list[bytes]:
        return [self.key(m) for m in range(first, self.n)]


class ChunkHasher:
    """Computes the chunk keys of token sequences; safe to share between threads (the only hash states it holds
    are each namespace's seed, which it copies and never updates, and the keys of the pages it hashed last)."""

    def __init__(self, chunk_size: int, algo: str = "blake3") -> None:
        if not _is_int(chunk_size) or chunk_size <= 0:
            raise ValueError(f"chunk_size={chunk_size!r} must be a positive int")
        self.chunk_size = chunk_size
        self.algo = algo
        self._seed = _seed_function(algo)
        self._seeds: dict[bytes, _Hasher] = {}  # namespace digest -> a hasher that has absorbed it
        # A page's key is found again by the load or store that follows its lookup: remembered, a 64-page load's
        # keys cost ~0.6 us a page instead of ~1.5 (a copy, an update and a digest of the hasher).
        self._page_key = functools.lru_cache(maxsize=_PAGE_KEYS_KEPT)(self._hash_page)

    def num_chunks(self, tokens: TokenIds) -> int:
        """Number of full chunks in ``tokens`` (the tail is not cached)."""
        return len(tokens) // self.chunk_size

    def prefix(self, tokens: TokenIds, namespace: CacheNamespace) -> PrefixKeys:
        """Keys of ``tokens``'s full chunks on demand (validates and converts ``tokens`` now)."""
        return PrefixKeys(token_view(tokens), self.chunk_size * 4, self._seeded(namespace.digest))

    def pages(self, tokens: TokenIds, namespace: CacheNamespace) -> PageKeys:
        """Keys of ``tokens``'s full chunks, each chunk keyed as a prefix of its own (`PageKeys`)."""
        return PageKeys(token_view(tokens), self.chunk_size * 4, functools.partial(self._page_key, namespace.digest))

    def keys_after(self, tokens: TokenIds, namespace: CacheNamespace, first: int) -> tuple[bytes | None, list[bytes]]:
        """The key of chunk ``first - 1`` (None when ``first`` is 0) and the keys of the full chunks from ``first``
        on, in one pass: what a store needs. The chunks before ``first`` are hashed in bulk, without a key each.
        (A store of one chunk is on the path to its copy: this costs half of ``prefix(...).keys(first)``.)"""
        data = token_view(tokens)
        step = self.chunk_size * 4
        end = len(data) // step * step
        at = first * step
        if at >= end:
            return None, []
        h = self._seeded(namespace.digest)
        update, digest = h.update, h.digest
        parent = None
        if at:
            update(data[:at])
            parent = digest()
        keys = []
        for start in range(at, end, step):
            update(data[start : start + step])
            keys.append(digest())
        return parent, keys

    def iter_keys(self, tokens: TokenIds, namespace: CacheNamespace) -> Iterator[bytes]:
        """Keys of the full chunks of ``tokens``, lazily (a caller that stops at the first miss hashes less)."""
        data = token_view(tokens)
        step = self.chunk_size * 4
        h = self._seeded(namespace.digest)
        for start in range(0, (len(data) // step) * step, step):
            h.update(data[start : start + step])
            yield h.digest()

    def keys(self, tokens: TokenIds, namespace: CacheNamespace) -> list[bytes]:
        """Keys of all full chunks of ``tokens``."""
        return self.prefix(tokens, namespace).keys()

    def _hash_page(self, digest: bytes, page: bytes) -> bytes:
        """The key of one page's bytes in the namespace of ``digest`` (`PageKeys`)."""
        h = self._seeded(digest)
        h.update(page)
        return h.digest()

    def _seeded(self, digest: bytes) -> _Hasher:
        """A fresh hasher seeded with a namespace digest (a copy of the one kept per namespace: half the cost)."""
        seed = self._seeds.get(digest)
        if seed is None:
            seed = self._seed(digest)
            if len(self._seeds) >= 256:  # a server's namespaces are few; bound it anyway
                self._seeds.clear()
            self._seeds[digest] = seed
        return seed.copy()


def token_view(tokens: TokenIds) -> memoryview:
    """``tokens`` as little-endian uint32 bytes (a byte view, copied only where the dtype needs converting);
    ValueError/TypeError naming ``tokens`` on bad input."""
    if type(tokens) is np.ndarray and tokens.dtype == _U32_LE and tokens.ndim == 1 and tokens.flags.c_contiguous:
        return tokens.view(np.uint8).data  # already the bytes hashed (ids off the wire): nothing to check
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise TypeError(
                f"tokens must be a 1-D integer tensor, got dtype={tokens.dtype} shape={tuple(tokens.shape)}"
            )
        tokens = tokens.detach().cpu().numpy()
    elif not isinstance(tokens, np.ndarray) and hasattr(tokens, "__array__"):  # an array-like made when read
        tokens = np.asarray(tokens)
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise TypeError(f"tokens must be a 1-D integer array, got dtype={tokens.dtype} shape={tokens.shape}")
        tokens = tokens.astype(tokens.dtype.newbyteorder("="), copy=False)
        # One reduction, no temporary: seen as uint64 a negative id is huge too (3x faster than `(x > c).any()`).
        if tokens.size and tokens.dtype.itemsize == 8:
            bad = int(tokens.view(np.uint64).max()) > 0xFFFFFFFF
        else:
            bad = tokens.size > 0 and tokens.dtype.kind == "i" and int(tokens.min()) < 0
        if bad:
            raise ValueError(
                f"tokens must be ids in [0, 2**32), got values in [{int(tokens.min())}, {int(tokens.max())}]"
            )
        return np.ascontiguousarray(tokens.astype("<u4", copy=False)).view(np.uint8).data
    try:
        # array.array is the fastest list -> uint32 packing measured (np.fromiter / np.array: 3x slower).
        packed = array.array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"tokens must be a sequence of ints in [0, 2**32): {exc}") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return memoryview(packed).cast("B")


def token_array(tokens: TokenIds) -> np.ndarray:
    """``tokens`` as a 1-D little-endian uint32 array, converted and checked once (an array of that kind is returned
    as it is). A connector's scheduler half keeps a prompt so: the lookups, the workers' loads and stores and the
    wire then hash and pack its slices with no conversion (a 4096-token list costs ~0.1 ms per conversion on a GPU
    host, on the path to a load's first DMA)."""
    if type(tokens) is np.ndarray and tokens.dtype == _U32_LE and tokens.ndim == 1 and tokens.flags.c_contiguous:
        return tokens
    return np.frombuffer(token_view(tokens), dtype=_U32_LE)


def token_bytes(tokens: TokenIds) -> bytes:
    """``tokens`` as little-endian uint32 bytes; ValueError/TypeError naming ``tokens`` on bad input."""
    return token_view(tokens).tobytes()


def _seed_function(algo: str) -> Callable[[bytes], _Hasher]:
    """`seed(namespace digest) -> a hasher that has absorbed the namespace`, ready for token bytes."""
    if algo == "sha256":
        # Copying a fresh context is ~30% cheaper than constructing one (OpenSSL 3 fetches the digest each time).
        empty = hashlib.sha256()

        def sha256_seed(digest: bytes) -> _Hasher:
            h = empty.copy()
            h.update(digest)
            return h

        return sha256_seed
    if algo == "blake3":
        return lambda digest: blake3.blake3(key=digest)  # keyed mode: the namespace is the key
    raise ValueError(f"hash algo={algo!r} is not supported; expected 'sha256' or 'blake3'")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

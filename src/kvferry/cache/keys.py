"""Cache keys: token ids cut into chunks, each chunk keyed by a rolling hash of the whole prefix up to it.

``key_i = H(key_{i-1} || tokens of chunk i)`` with ``key_{-1}`` the namespace's digest, so a key identifies the
namespace and every token before the end of its chunk: two prompts share exactly the keys of the chunks before
their first differing token. Token ids are hashed as little-endian uint32, so keys are the same in every process
and on every machine (never Python's ``hash``, which is salted per process).

Tail policy: only full chunks get keys. The tokens after the last full chunk are never stored and never count
as a hit; an engine recomputes them (at most ``chunk_size - 1`` tokens per request).
"""

from __future__ import annotations

import array
import hashlib
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import blake3
import numpy as np
import torch

TokenIds = Sequence[int] | np.ndarray | torch.Tensor
KEY_BYTES = 32
_KEY_SCHEMA = "kvferry-cache-key-v1"


@dataclass(frozen=True)
class CacheNamespace:
    """Everything that must match for two processes to share KV objects: the key space of one deployment.

    ``layout`` names the object layout (engine format and object shape); ``salt`` separates deployments (or
    tenants) that would otherwise share. The digest seeds every key, so different namespaces never collide.
    """

    model: str
    kv_dtype: str
    layout: str
    world_size: int = 1
    rank: int = 0
    salt: str = ""
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("model", "kv_dtype", "layout"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"CacheNamespace.{name}={value!r} must be a non-empty string")
        if not isinstance(self.salt, str):
            raise TypeError(f"CacheNamespace.salt={self.salt!r} must be a string")
        if not _is_int(self.world_size) or self.world_size < 1:
            raise ValueError(f"CacheNamespace.world_size={self.world_size!r} must be an int >= 1")
        if not _is_int(self.rank) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"CacheNamespace.rank={self.rank!r} must be an int in [0, {self.world_size})")
        canonical = json.dumps(
            [_KEY_SCHEMA, self.model, self.kv_dtype, self.layout, self.world_size, self.rank, self.salt],
            separators=(",", ":"),
        ).encode()
        object.__setattr__(self, "digest", hashlib.sha256(canonical).digest())


class ChunkHasher:
    """Computes the chunk keys of token sequences; safe to share between threads (it holds no hash state)."""

    def __init__(self, chunk_size: int, algo: str = "sha256") -> None:
        if not _is_int(chunk_size) or chunk_size <= 0:
            raise ValueError(f"chunk_size={chunk_size!r} must be a positive int")
        self.chunk_size = chunk_size
        self.algo = algo
        self._hash = _hash_function(algo)

    def num_chunks(self, tokens: TokenIds) -> int:
        """Number of full chunks in ``tokens`` (the tail is not cached)."""
        return len(tokens) // self.chunk_size

    def iter_keys(self, tokens: TokenIds, namespace: CacheNamespace) -> Iterator[bytes]:
        """Keys of the full chunks of ``tokens``, lazily (a caller that stops at the first miss hashes less)."""
        data = memoryview(token_bytes(tokens))  # slices of a view copy nothing
        step = self.chunk_size * 4
        hash_fn = self._hash
        key = namespace.digest
        for start in range(0, (len(data) // step) * step, step):
            key = hash_fn(key, data[start : start + step])
            yield key

    def keys(self, tokens: TokenIds, namespace: CacheNamespace) -> list[bytes]:
        """Keys of all full chunks of ``tokens``."""
        return list(self.iter_keys(tokens, namespace))


def token_bytes(tokens: TokenIds) -> bytes:
    """``tokens`` as little-endian uint32 bytes; ValueError/TypeError naming ``tokens`` on bad input."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise TypeError(
                f"tokens must be a 1-D integer tensor, got dtype={tokens.dtype} shape={tuple(tokens.shape)}"
            )
        tokens = tokens.detach().cpu().numpy()
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise TypeError(f"tokens must be a 1-D integer array, got dtype={tokens.dtype} shape={tokens.shape}")
        tokens = tokens.astype(tokens.dtype.newbyteorder("="), copy=False)
        # One vectorised pass: seen as uint64, a negative id is huge too.
        if tokens.dtype.itemsize == 8:
            bad = bool((tokens.view(np.uint64) > 0xFFFFFFFF).any())
        else:
            bad = tokens.dtype.kind == "i" and bool((tokens < 0).any())
        if bad:
            raise ValueError(
                f"tokens must be ids in [0, 2**32), got values in [{int(tokens.min())}, {int(tokens.max())}]"
            )
        return tokens.astype("<u4", copy=False).tobytes()
    try:
        packed = array.array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"tokens must be a sequence of ints in [0, 2**32): {exc}") from None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _hash_function(algo: str) -> Callable[[bytes, memoryview], bytes]:
    """`step(previous key, chunk bytes) -> H(previous key || chunk bytes)`."""
    if algo == "sha256":
        # Copying a fresh context is ~30% cheaper than constructing one (OpenSSL 3 fetches the digest each time),
        # and updating twice avoids concatenating 1 KiB per chunk.
        empty = hashlib.sha256()

        def sha256_step(previous: bytes, chunk: memoryview) -> bytes:
            h = empty.copy()
            h.update(previous)
            h.update(chunk)
            return h.digest()

        return sha256_step
    if algo == "blake3":
        b3 = blake3.blake3
        return lambda previous, chunk: b3(previous + chunk).digest()
    raise ValueError(f"hash algo={algo!r} is not supported; expected 'sha256' or 'blake3'")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

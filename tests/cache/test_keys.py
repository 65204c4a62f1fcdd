"""Chunk keys: deterministic across processes, prefix semantics, namespace separation, input types."""

from __future__ import annotations

import dataclasses
import hashlib
import multiprocessing

import blake3
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.cache.keys import _KEY_SCHEMA, CacheNamespace, ChunkHasher, token_array, token_bytes

ALGOS = ("sha256", "blake3")
NS = CacheNamespace("llama-3-8b", "bfloat16", "NL_X_TWO_NB_BS_NH_HS:2x32x256x1024", world_size=2, rank=1)
OTHER = CacheNamespace("llama-3-8b", "bfloat16", "NL_X_TWO_NB_BS_NH_HS:2x32x256x1024", world_size=2, rank=0)


def _random_tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 150_000, size=n).tolist()


def _keys_in_child(tokens: list[int]) -> dict[str, list[str]]:
    return {algo: [k.hex() for k in ChunkHasher(64, algo).keys(tokens, NS)] for algo in ALGOS}


def test_keys_identical_in_a_spawned_process() -> None:
    tokens = _random_tokens(64 * 5 + 17)
    with multiprocessing.get_context("spawn").Pool(1) as child:
        theirs = child.apply(_keys_in_child, (tokens,))
    ours = _keys_in_child(tokens)
    assert theirs == ours
    assert [len(keys) for keys in ours.values()] == [5, 5]


def test_known_answer_pins_the_key_schema() -> None:
    # A change here breaks every persisted tier and every other kvferry process: bump _KEY_SCHEMA instead.
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    data = np.array(tokens, "<u4").tobytes()
    assert _KEY_SCHEMA == "kvferry-cache-key-v2"
    sha = ChunkHasher(4, "sha256").keys(tokens, NS)
    assert sha == [hashlib.sha256(NS.digest + data[:16]).digest(), hashlib.sha256(NS.digest + data[:32]).digest()]
    b3 = ChunkHasher(4, "blake3").keys(tokens, NS)
    assert b3 == [blake3.blake3(data[:16], key=NS.digest).digest(), blake3.blake3(data[:32], key=NS.digest).digest()]
    assert ChunkHasher(4).algo == "blake3"  # the default


# Digests of namespaces as earlier releases made them, every typed field then appended to the salt by the connector
# (``salt|group|split|kv_cache_dtype=...``): disk and Redis tiers hold objects under the keys they seed.
_LAYOUT = "NL_X_TWO_NB_BS_NH_HS:2x32x256x1024"
_KNOWN_DIGESTS = [
    (NS, "630fca1e1eaf0a7230c10c22a81ced42c5c3a2e41b47c97099adf788e5f9cabf"),
    (
        CacheNamespace(
            "llama-3-8b", "uint8", _LAYOUT, salt="tenant-a", codec="fp8",
            kv_cache_dtype="fp8_e4m3", group="group=1:full", split="exact_layers=1",
        ),
        "c99edee8fb198f266c5e9f2e5fc49b5e2024da2ba09df2967450a37f9c27d40f",
    ),
    (
        CacheNamespace("llama-3-8b", "bfloat16", _LAYOUT, group="group=0:sliding_window:4096"),
        "525ed407c2f49f85749e0933ff9112f732d856cd554a131673f2325c64eb6298",
    ),
    (
        CacheNamespace("llama-3-8b", "bfloat16", _LAYOUT, salt="s", codec="fp8", split="exact_layers=0,31"),
        "99d19c4dd429d6ac07b97f45fec4fd0b7e86c0ae8bb42ea7c33b93cee88abb61",
    ),
    (
        CacheNamespace("llama-3-8b", "uint8", _LAYOUT, salt="s", kv_cache_dtype="fp8_e5m2"),
        "230e0f5ad3ad61aa75dde9615abbfd256ed2f26c8af9e76ac87aa054cf36f4a3",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("namespace", "digest"), _KNOWN_DIGESTS, ids=["plain", "every-field", "group", "split", "fp8"])
def test_typed_fields_keep_the_keys_of_earlier_releases(namespace: CacheNamespace, digest: str) -> None:
    # A change here makes every persisted tier miss: bump _KEY_SCHEMA instead.
    assert namespace.digest.hex() == digest
    salt = namespace.salt + "".join(f"|{tag}" for tag in (namespace.group, namespace.split) if tag is not None)
    if namespace.kv_cache_dtype is not None:
        salt += f"|kv_cache_dtype={namespace.kv_cache_dtype}"
    untyped = dataclasses.replace(namespace, salt=salt, kv_cache_dtype=None, group=None, split=None)
    assert untyped.digest == namespace.digest  # as an earlier release's connector named it
    key = ChunkHasher(4).keys([1, 2, 3, 4, 5, 6, 7, 8, 9], namespace)[1]
    assert key == blake3.blake3(np.arange(1, 9, dtype="<u4").tobytes(), key=bytes.fromhex(digest)).digest()


def test_a_cache_dtype_that_the_tensors_name_is_no_field_of_its_own() -> None:
    same = CacheNamespace("m", "bfloat16", "L", kv_cache_dtype="bfloat16")
    assert same == CacheNamespace("m", "bfloat16", "L") and same.kv_cache_dtype is None
    assert same.digest == CacheNamespace("m", "bfloat16", "L").digest


@settings(max_examples=30, deadline=None)
@given(n_chunks=st.integers(1, 200), probes=st.lists(st.integers(0, 10_000), max_size=12), algo=st.sampled_from(ALGOS))
def test_prefix_keys_in_any_probe_order_match_the_stream(n_chunks: int, probes: list[int], algo: str) -> None:
    # Probes land behind, between and past the saved states (every 64 chunks and at every probe).
    hasher = ChunkHasher(4, algo)
    tokens = _random_tokens(4 * n_chunks + 3, seed=n_chunks)
    expected = list(hasher.iter_keys(tokens, NS))
    prefix = hasher.prefix(tokens, NS)
    assert prefix.n == n_chunks
    for p in probes:
        assert prefix.key(p % n_chunks) == expected[p % n_chunks]
    first = probes[0] % n_chunks if probes else 0
    assert prefix.keys(first) == expected[first:]
    with pytest.raises(IndexError):
        prefix.key(n_chunks)


@settings(max_examples=30, deadline=None)
@given(n_chunks=st.integers(0, 150), first=st.integers(0, 160), algo=st.sampled_from(ALGOS))
def test_a_stores_keys_in_one_pass_match_the_stream(n_chunks: int, first: int, algo: str) -> None:
    """`keys_after` (a store's keys: the parent of chunk `first` and the keys from it on) equals the streamed keys,
    for any start, including past the end; and a second namespace through the same hasher gets its own keys (the
    seeded hashers it keeps per namespace are copied, never updated)."""
    hasher = ChunkHasher(4, algo)
    tokens = _random_tokens(4 * n_chunks + 3, seed=first)
    expected = list(hasher.iter_keys(tokens, NS))
    for ns, want in ((NS, expected), (OTHER, list(ChunkHasher(4, algo).iter_keys(tokens, OTHER))), (NS, expected)):
        parent, keys = hasher.keys_after(tokens, ns, first)
        assert keys == want[first:]
        assert parent == (want[first - 1] if 0 < first <= n_chunks and keys else None)
    assert not set(expected) & set(hasher.keys(tokens, OTHER))


@settings(max_examples=40, deadline=None)
@given(k=st.integers(0, 5), offset=st.integers(0, 31), n_chunks=st.integers(1, 6), algo=st.sampled_from(ALGOS))
def test_a_diverging_token_in_chunk_k_shares_exactly_k_keys(k: int, offset: int, n_chunks: int, algo: str) -> None:
    hasher = ChunkHasher(32, algo)
    tokens = _random_tokens(32 * n_chunks + 7, seed=k)
    other = list(tokens)
    pos = min(32 * k + offset, len(tokens) - 1)
    other[pos] = (other[pos] + 1) % 150_000
    a, b = hasher.keys(tokens, NS), hasher.keys(other, NS)
    shared = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    assert shared == min(pos // 32, n_chunks)
    assert all(x != y for x, y in zip(a[shared:], b[shared:], strict=True))


def test_tail_is_not_keyed() -> None:
    hasher = ChunkHasher(16)
    tokens = _random_tokens(16 * 3 + 15)
    assert hasher.num_chunks(tokens) == 3
    assert hasher.keys(tokens, NS) == hasher.keys(tokens[:48], NS)
    assert hasher.keys(tokens[:15], NS) == []


def test_iter_keys_is_lazy_and_matches_keys() -> None:
    hasher = ChunkHasher(16)
    tokens = _random_tokens(16 * 4)
    it = hasher.iter_keys(tokens, NS)
    assert next(it) == hasher.keys(tokens, NS)[0]


@pytest.mark.parametrize("kind", ["list", "int64", "int32", "tensor"])
def test_a_token_array_holds_the_bytes_hashed_and_is_kept_as_it_is(kind: str) -> None:
    ids = [0, 1, 7, 2**31, 2**32 - 1]
    given = {"list": ids, "int64": np.array(ids, dtype=np.int64), "int32": np.array(ids[:3], dtype=np.int32),
             "tensor": torch.tensor(ids, dtype=torch.int64)}[kind]  # fmt: skip
    array = token_array(given)
    assert array.dtype == np.dtype("<u4") and array.tobytes() == token_bytes(given)
    assert token_array(array) is array and np.shares_memory(token_array(array[1:3]), array)  # no copy, slices too
    hasher = ChunkHasher(2)
    assert hasher.keys(array, NS) == hasher.keys(list(array.tolist()), NS)


@pytest.mark.parametrize("bad", [[-1, 2], [2**32], np.array([-3], dtype=np.int64), np.array([1.5])])
def test_a_token_array_refuses_ids_out_of_range(bad: object) -> None:
    with pytest.raises((ValueError, TypeError), match="tokens must"):
        token_array(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "field,value",
    [
        ("model", "llama-3-70b"),
        ("kv_dtype", "float16"),
        ("layout", "NL_X_NB_TWO_BS_NH_HS:2x32x256x1024"),
        ("world_size", 4),
        ("rank", 0),
        ("salt", "tenant-b"),
        ("codec", "fp8"),
        ("kv_cache_dtype", "fp8_e4m3"),
        ("group", "group=0:full"),
        ("split", "exact_layers=0"),
    ],
)
def test_every_namespace_field_separates_keys(field: str, value: object) -> None:
    other = dataclasses.replace(NS, **{field: value})
    tokens = _random_tokens(64)
    assert set(ChunkHasher(16).keys(tokens, NS)).isdisjoint(ChunkHasher(16).keys(tokens, other))
    assert other != NS and other.digest != NS.digest


def test_algos_differ_and_unknown_algo_is_rejected() -> None:
    tokens = _random_tokens(32)
    assert ChunkHasher(16, "sha256").keys(tokens, NS) != ChunkHasher(16, "blake3").keys(tokens, NS)
    with pytest.raises(ValueError, match="md5"):
        ChunkHasher(16, "md5")
    with pytest.raises(ValueError, match="chunk_size"):
        ChunkHasher(0)


def test_token_containers_give_the_same_keys() -> None:
    tokens = _random_tokens(100)
    hasher = ChunkHasher(32)
    expected = hasher.keys(tokens, NS)
    for container in (
        tuple(tokens),
        np.array(tokens, dtype=np.int64),
        np.array(tokens, dtype=np.uint32),
        np.frombuffer(np.array(tokens, dtype="<u4").tobytes(), dtype="<u4"),  # ids off the wire: hashed as they are
        np.array(tokens, dtype=">u4"),
        np.repeat(np.array(tokens, dtype="<u4"), 2)[::2],  # strided
        torch.tensor(tokens, dtype=torch.int64),
        torch.tensor(tokens, dtype=torch.int32),
        _ArrayLike(np.array(tokens, dtype=np.int64)),  # made when read (numpy's array protocol)
    ):
        assert hasher.keys(container, NS) == expected


class _ArrayLike:
    """Token ids behind numpy's array protocol only."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __len__(self) -> int:
        return len(self.array)

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        return self.array


@pytest.mark.parametrize(
    "tokens,error",
    [
        ([1, -2, 3], ValueError),
        ([1, 2**32], ValueError),
        ([1.5, 2], ValueError),
        (np.array([1, -1]), ValueError),
        (np.array([1, -1], dtype=np.int32), ValueError),
        (np.array([2**40], dtype=np.uint64), ValueError),
        (torch.tensor([3, -3]), ValueError),
        (np.array([1.0, 2.0]), TypeError),
        (torch.zeros(2, 2, dtype=torch.int64), TypeError),
        (torch.tensor([1.0]), TypeError),
        (_ArrayLike(np.array([1, -1])), ValueError),
        (_ArrayLike(np.array([[1, 2]])), TypeError),
    ],
)
def test_bad_tokens_raise_naming_tokens(tokens: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="tokens"):
        token_bytes(tokens)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"model": ""}, "model"),
        ({"world_size": 0}, "world_size"),
        ({"rank": 2}, "rank"),
        ({"rank": -1}, "rank"),
        ({"salt": 3}, "salt"),
        ({"codec": ""}, "codec"),
        ({"group": ""}, "group"),
        ({"group": "group=0|full"}, "group"),
        ({"split": 3}, "split"),
        ({"kv_cache_dtype": "fp8|e4m3"}, "kv_cache_dtype"),
    ],
)
def test_bad_namespace_fields_raise(kwargs: dict[str, object], match: str) -> None:
    fields: dict[str, object] = {"model": "m", "kv_dtype": "bfloat16", "layout": "L", "world_size": 2, "rank": 0}
    fields.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        CacheNamespace(**fields)  # type: ignore[arg-type]

"""HostPool: construction checks, exact accounting, full pool, coalescing, view layout and misuse."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from kvferry.memory import Allocation, HostPool, PoolFullError

KIB = 1024
MIB = 1024 * KIB


def random_fill(tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Overwrite ``tensor`` (any dtype) with random bytes and return a private copy of them."""
    raw = tensor.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
    return raw.clone()


def round_up(nbytes: int, alignment: int) -> int:
    return -(-nbytes // alignment) * alignment


@pytest.mark.parametrize("alignment", [0, 32, 100, 4095, True, 4096.0])
def test_rejects_bad_alignment(alignment: object) -> None:
    with pytest.raises(ValueError, match=r"alignment=.* must be a power of two >= 64"):
        HostPool(MIB, alignment=alignment)  # type: ignore[arg-type]


@pytest.mark.parametrize("capacity", [0, -4096, 4096 * 3 + 1, 1.5 * MIB])
def test_rejects_bad_capacity(capacity: object) -> None:
    with pytest.raises(ValueError, match=r"capacity_bytes=.* must be a positive multiple of alignment=4096"):
        HostPool(capacity)  # type: ignore[arg-type]


def test_bad_capacity_message_suggests_a_valid_one() -> None:
    with pytest.raises(ValueError, match=r"e\.g\. 12,288"):
        HostPool(4096 * 3 + 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_pin_true_without_cuda_is_refused() -> None:
    with pytest.raises(ValueError, match="pin=True needs CUDA"):
        HostPool(MIB, pin=True)


@pytest.mark.parametrize("alignment", [64, 4096, 1 << 16, 1 << 21])
def test_slab_is_aligned_uint8_of_capacity(alignment: int) -> None:
    pool = HostPool(4 * max(alignment, 4096), alignment=alignment)
    assert pool.slab.dtype == torch.uint8
    assert pool.slab.shape == (pool.capacity_bytes,)
    assert pool.slab.data_ptr() % alignment == 0
    assert pool.alignment == alignment
    assert pool.is_pinned == torch.cuda.is_available()
    assert pool.used_bytes == 0 and pool.free_bytes == pool.largest_free_bytes == pool.capacity_bytes


def test_unpinned_on_request() -> None:
    pool = HostPool(MIB, pin=False)
    assert not pool.is_pinned
    assert not pool.slab.is_pinned()


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((1,), torch.uint8),
        ((), torch.float32),
        ((4096,), torch.uint8),
        ((4097,), torch.uint8),
        ((2, 32, 256, 128), torch.bfloat16),
        ((3, 5, 7), torch.float64),
        ((1, 61, 64, 576), torch.float8_e4m3fn),
        ((9,), torch.complex64),
    ],
)
def test_accounting_is_exact(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    pool = HostPool(8 * MIB)
    tensor = pool.alloc(shape, dtype)
    nbytes = tensor.numel() * tensor.element_size()
    assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous()
    assert pool.used_bytes == round_up(nbytes, 4096)
    assert pool.requested_bytes == nbytes
    assert pool.free_bytes == pool.capacity_bytes - pool.used_bytes
    assert pool.num_allocations == 1
    assert pool.allocation(tensor) == Allocation(pool.offset_of(tensor), nbytes, round_up(nbytes, 4096))
    stats = pool.stats()
    assert stats["used_bytes"] == pool.used_bytes
    assert stats["alignment_waste_bytes"] == pool.used_bytes - nbytes
    assert stats["num_allocations"] == 1
    pool.free(tensor)
    assert pool.used_bytes == pool.requested_bytes == pool.num_allocations == 0


def test_accepts_torch_size_and_numpy_style_ints() -> None:
    pool = HostPool(MIB)
    assert pool.alloc(torch.Size([2, 3]), torch.int32).shape == (2, 3)
    assert pool.alloc([np.int64(4), 5], torch.int16).shape == (4, 5)


@pytest.mark.parametrize(
    ("shape", "dtype", "error", "match"),
    [
        ((0,), torch.uint8, ValueError, "zero-size"),
        ((4, 0, 2), torch.float16, ValueError, "zero-size"),
        ((-2, -3), torch.float16, ValueError, "every dimension >= 1"),
        ((2.5,), torch.float16, TypeError, "sequence of ints"),
        (7, torch.float16, TypeError, "sequence of ints"),
        ((7,), "float16", TypeError, "must be a torch.dtype"),
    ],
)
def test_rejects_bad_layouts_without_leaking(shape: object, dtype: object, error: type, match: str) -> None:
    pool = HostPool(MIB)
    for method in (pool.alloc, pool.try_alloc):
        with pytest.raises(error, match=match):
            method(shape, dtype)  # type: ignore[arg-type]
    assert pool.used_bytes == 0 and pool.num_allocations == 0


def test_failed_view_gives_the_reservation_back(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = HostPool(MIB)

    def broken_view(*args: object) -> torch.Tensor:
        raise RuntimeError("view failed")

    monkeypatch.setattr(torch.Tensor, "view", broken_view)
    with pytest.raises(RuntimeError, match="view failed"):
        pool.alloc((10,), torch.uint8)
    assert pool.used_bytes == pool.requested_bytes == pool.num_allocations == 0
    assert pool.largest_free_bytes == pool.capacity_bytes


def test_full_pool_raises_with_numbers_and_try_alloc_returns_none() -> None:
    pool = HostPool(64 * KIB)
    first = pool.alloc((40 * KIB,), torch.uint8)
    with pytest.raises(PoolFullError) as caught:
        pool.alloc((8, KIB), torch.float32)  # 32 KiB, 24 KiB free
    error = caught.value
    assert isinstance(error, MemoryError)
    assert (error.requested_bytes, error.reserved_bytes) == (32 * KIB, 32 * KIB)
    assert (error.free_bytes, error.largest_free_bytes, error.capacity_bytes) == (
        24 * KIB,
        24 * KIB,
        64 * KIB,
    )
    message = str(error)
    for expected in ("shape=(8, 1024)", "torch.float32", "32,768", "24,576", "65,536"):
        assert expected in message
    assert "not in one extent" not in message
    assert pool.try_alloc((8, KIB), torch.float32) is None
    assert pool.used_bytes == 40 * KIB and pool.num_allocations == 1
    pool.free(first)
    assert pool.alloc((8, KIB), torch.float32).shape == (8, KIB)


def test_full_message_says_when_free_space_is_fragmented() -> None:
    pool = HostPool(16 * KIB)
    blocks = [pool.alloc((4 * KIB,), torch.uint8) for _ in range(4)]
    pool.free(blocks[0])
    pool.free(blocks[2])
    with pytest.raises(PoolFullError, match="not in one extent") as caught:
        pool.alloc((8 * KIB,), torch.uint8)
    assert (caught.value.free_bytes, caught.value.largest_free_bytes) == (8 * KIB, 4 * KIB)


def test_request_larger_than_capacity_is_full_not_a_crash() -> None:
    pool = HostPool(64 * KIB)
    with pytest.raises(PoolFullError, match="65,540"):
        pool.alloc((16 * KIB + 1,), torch.float32)
    assert pool.try_alloc((1 << 40,), torch.float64) is None


def test_free_returns_space_and_coalescing_allows_a_big_allocation() -> None:
    pool = HostPool(16 * 4096)
    blocks = [pool.alloc((4096,), torch.uint8) for _ in range(16)]
    assert pool.try_alloc((1,), torch.uint8) is None
    for index in (5, 7, 6, 4):  # free four neighbours in an order that merges left, right and both
        pool.free(blocks[index])
    assert pool.free_bytes == pool.largest_free_bytes == 4 * 4096
    assert pool.num_free_extents == 1
    big = pool.alloc((4, 1024), torch.float32)
    assert pool.offset_of(big) == 4 * 4096
    for index in (0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15):
        pool.free(blocks[index])
    pool.free(big)
    assert pool.largest_free_bytes == pool.capacity_bytes and pool.num_free_extents == 1


@pytest.mark.parametrize("alignment", [64, 4096])
def test_mixed_views_are_aligned_and_disjoint(alignment: int) -> None:
    rng = random.Random(7)
    generator = torch.Generator().manual_seed(7)
    pool = HostPool(4 * MIB, alignment=alignment)
    dtypes = [torch.uint8, torch.bfloat16, torch.float32, torch.int64, torch.float8_e5m2, torch.complex128]
    live: list[tuple[torch.Tensor, torch.Tensor]] = []
    for _ in range(300):
        if live and rng.random() < 0.3:
            tensor, _ = live.pop(rng.randrange(len(live)))
            pool.free(tensor)
            continue
        shape = tuple(rng.randint(1, 12) for _ in range(rng.randint(1, 4)))
        tensor = pool.try_alloc(shape, rng.choice(dtypes))
        if tensor is None:
            continue
        assert tensor.shape == shape and tensor.is_contiguous()
        assert tensor.data_ptr() % alignment == 0 and pool.offset_of(tensor) % alignment == 0
        live.append((tensor, random_fill(tensor, generator)))
    assert len({t.dtype for t, _ in live}) > 3, "the pool should hold several dtypes at once"
    for tensor, expected in live:
        assert torch.equal(tensor.view(-1).view(torch.uint8), expected), "an allocation overwrote another"
        assert pool.slab[pool.offset_of(tensor)] == expected[0]


def test_double_free_foreign_and_inner_views_are_rejected() -> None:
    pool = HostPool(MIB)
    tensor = pool.alloc((4, 256), torch.float32)
    with pytest.raises(ValueError, match="does not point into this pool's slab"):
        pool.free(torch.empty(4, 256))
    with pytest.raises(ValueError, match="not a live allocation"):
        pool.free(tensor[1])
    with pytest.raises(ValueError, match="does not point into this pool's slab"):
        pool.allocation(torch.empty(3))
    pool.free(tensor.view(-1))  # a view starting at the allocation identifies it
    with pytest.raises(ValueError, match=r"not a live allocation.*already freed"):
        pool.free(tensor)
    assert pool.used_bytes == 0 and pool.largest_free_bytes == pool.capacity_bytes


def test_offset_of_accepts_inner_views_and_rejects_foreign_tensors() -> None:
    pool = HostPool(MIB)
    pool.alloc((5000,), torch.uint8)
    tensor = pool.alloc((16, 64), torch.int32)
    assert pool.offset_of(tensor) == 8192
    assert pool.offset_of(tensor[2]) == 8192 + 2 * 64 * 4
    with pytest.raises(ValueError, match=r"offset_of: .* is not inside this pool's slab"):
        pool.offset_of(torch.empty(3))
    other = HostPool(MIB)
    with pytest.raises(ValueError, match="not inside"):
        pool.offset_of(other.alloc((1,), torch.uint8))


def test_stats_and_repr() -> None:
    pool = HostPool(64 * KIB, alignment=1024)
    a = pool.alloc((100,), torch.uint8)
    pool.alloc((2000,), torch.uint8)
    pool.free(a)
    stats = pool.stats()
    assert stats == {
        "capacity_bytes": 64 * KIB,
        "used_bytes": 2048,
        "requested_bytes": 2000,
        "alignment_waste_bytes": 48,
        "free_bytes": 64 * KIB - 2048,
        "largest_free_bytes": 64 * KIB - 3072,
        "num_allocations": 1,
        "num_free_extents": 2,
        "utilization": 2048 / (64 * KIB),
        "fragmentation": 1 - (64 * KIB - 3072) / (64 * KIB - 2048),
        "alignment": 1024,
        "is_pinned": torch.cuda.is_available(),
    }
    assert "used_bytes=2,048" in repr(pool)


def test_threads_share_the_pool_safely() -> None:
    pool = HostPool(2 * MIB)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        generator = torch.Generator().manual_seed(seed)
        live: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            for _ in range(1500):
                if live and rng.random() < 0.5:
                    tensor, expected = live.pop(rng.randrange(len(live)))
                    assert torch.equal(tensor.view(-1).view(torch.uint8), expected)
                    pool.free(tensor)
                else:
                    tensor = pool.try_alloc((rng.randint(1, 20_000),), torch.uint8)
                    if tensor is not None:
                        live.append((tensor, random_fill(tensor, generator)))
            for tensor, expected in live:
                assert torch.equal(tensor, expected)
                pool.free(tensor)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert pool.used_bytes == pool.requested_bytes == pool.num_allocations == 0
    assert pool.largest_free_bytes == pool.capacity_bytes and pool.num_free_extents == 1


def test_alloc_many_gives_one_run_of_separate_allocations() -> None:
    pool = HostPool(MIB)
    generator = torch.Generator().manual_seed(3)
    objects = pool.try_alloc_many((3, 100), torch.bfloat16, 5)  # 600 bytes each: 4 KiB apart
    assert [pool.offset_of(o) for o in objects] == [k * 4096 for k in range(5)]
    assert all(o.shape == (3, 100) and o.dtype == torch.bfloat16 and o.is_contiguous() for o in objects)
    assert pool.requested_bytes == 5 * 600 and pool.used_bytes == 5 * 4096 and pool.num_allocations == 5
    written = [random_fill(o, generator) for o in objects]
    for o, w in zip(objects, written, strict=True):  # disjoint: no object overwrote another
        assert torch.equal(o.view(-1).view(torch.uint8), w)
    pool.free(objects[2])  # each is its own allocation
    assert pool.used_bytes == 4 * 4096 and pool.try_alloc((4096,), torch.uint8) is not None


def test_alloc_many_falls_back_to_single_extents_and_stops_when_full() -> None:
    pool = HostPool(8 * 4096)
    blocks = [pool.alloc((4096,), torch.uint8) for _ in range(8)]
    for index in (1, 3, 4, 6):  # free space: 1, 3-4, 6 (no run of 4)
        pool.free(blocks[index])
    got = pool.try_alloc_many((4096,), torch.uint8, 6)
    assert sorted(pool.offset_of(o) for o in got) == [4096, 3 * 4096, 4 * 4096, 6 * 4096]
    assert pool.free_bytes == 0 and pool.num_allocations == 8
    assert pool.try_alloc_many((4096,), torch.uint8, 3) == []
    assert pool.try_alloc_many((4096,), torch.uint8, 0) == []


def test_alloc_many_failed_views_give_every_reservation_back(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = HostPool(MIB)

    def broken(*args: object) -> torch.Tensor:
        raise RuntimeError("unbind failed")

    monkeypatch.setattr(torch.Tensor, "unbind", broken)
    with pytest.raises(RuntimeError, match="unbind failed"):
        pool.try_alloc_many((10,), torch.uint8, 4)
    assert pool.used_bytes == pool.requested_bytes == pool.num_allocations == 0
    assert pool.largest_free_bytes == pool.capacity_bytes and pool.num_free_extents == 1


def test_a_view_carved_before_comes_back_only_with_its_own_layout() -> None:
    """The pool hands out a view it carved before at the same offset, shape and dtype (no new as_strided); any
    other layout at that offset gets its own view, and each view covers exactly its allocation."""
    pool = HostPool(16 * KIB)
    first = pool.alloc((4, 256), torch.float32)
    pool.free(first)
    again = pool.alloc((4, 256), torch.float32)
    assert again is first  # same offset, shape, dtype
    pool.free(again)
    for shape, dtype in (((256, 4), torch.float32), ((4, 256), torch.int32), ((2, 512), torch.bfloat16)):
        view = pool.alloc(shape, dtype)
        assert view is not first and tuple(view.shape) == shape and view.dtype == dtype and view.is_contiguous()
        assert pool.offset_of(view) == 0 and view.nbytes == pool.allocation(view).requested_bytes
        pool.free(view)
    assert pool.used_bytes == 0 and pool.num_allocations == 0


def test_reserve_many_then_views_then_free_by_address() -> None:
    """Allocations by address first (what a GPU store hands its copy before it needs tensors), their views carved
    later: the same places and accounting as try_alloc_many; freed by address or by view, each exactly once."""
    pool = HostPool(MIB)
    addresses = pool.try_reserve_many((3, 100), torch.bfloat16, 4)
    assert [a - pool.slab.data_ptr() for a in addresses] == [k * 4096 for k in range(4)]
    assert pool.requested_bytes == 4 * 600 and pool.used_bytes == 4 * 4096 and pool.num_allocations == 4
    views = pool.views(addresses, (3, 100), torch.bfloat16)
    assert [v.data_ptr() for v in views] == addresses
    assert all(v.shape == (3, 100) and v.dtype == torch.bfloat16 and v.is_contiguous() for v in views)
    written = [random_fill(v, torch.Generator().manual_seed(i)) for i, v in enumerate(views)]
    assert all(torch.equal(v.view(-1).view(torch.uint8), w) for v, w in zip(views, written, strict=True))
    with pytest.raises(ValueError, match="no live allocation of 1,200 bytes"):
        pool.views(addresses[:1], (6, 100), torch.bfloat16)  # not the reserved size
    pool.free_address(addresses[0])
    pool.free(views[1])
    with pytest.raises(ValueError, match="not a live allocation"):
        pool.free_address(addresses[0])
    with pytest.raises(ValueError, match="no live allocation"):
        pool.views(addresses[:2], (3, 100), torch.bfloat16)
    with pytest.raises(ValueError, match="does not point into this pool"):
        pool.free_address(12345)
    for a in addresses[2:]:
        pool.free_address(a)
    assert pool.used_bytes == pool.requested_bytes == pool.num_allocations == 0
    assert pool.largest_free_bytes == pool.capacity_bytes and pool.num_free_extents == 1
    full = HostPool(2 * 4096)
    assert len(full.try_reserve_many((4096,), torch.uint8, 3)) == 2  # fewer once full


def _resident_fraction(t: torch.Tensor) -> float:
    """Fraction of `t`'s pages mapped in memory (mincore)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    pages = -(-(t.data_ptr() + t.numel() * t.element_size() - start) // page)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) / pages


@pytest.mark.skipif(sys.platform != "linux", reason="mincore")
def test_populate_maps_every_page_of_an_unpinned_slab() -> None:
    """In a fresh process: after a long test run the allocator may hand a new pool memory that earlier tests touched,
    which would make the lazy pool look populated."""
    script = (
        "import sys; sys.path[:0] = sys.argv[1:]\n"
        "from tests.memory.test_host_pool import MIB, HostPool, _resident_fraction\n"
        "lazy = HostPool(64 * MIB, pin=False)\n"
        "populated = HostPool(64 * MIB, pin=False, populate=True)\n"
        "print(_resident_fraction(lazy.slab), _resident_fraction(populated.slab))\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", script, str(root), str(root / "src")], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lazy, populated = map(float, done.stdout.split())
    assert lazy < 0.5  # fresh anonymous memory: mapped on first touch
    assert populated == 1.0

import errno
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

import kvferry.tiers.disk as disk_module
from kvferry.memory import HostPool
from kvferry.tiers import DiskTier, TierURLError, make_tier
from tests.tiers.tierkit import AlignedAlloc, key, plain_alloc, random_tensor, same_bits

SHAPE = (2, 2, 64, 96)  # 48 KiB of bf16: 12 whole blocks
ODD_SHAPE = (2, 1, 16, 100)  # 6400 B of fp16: ends inside a block
FILE_BYTES = 4096 + 49152  # header block + payload


def _files(root: Path, pattern: str = "*.kvf") -> list[Path]:
    return sorted(root.glob(f"*/{pattern}"))


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def _metric(tier: DiskTier, op: str, result: str) -> float:
    value = tier.metrics_registry.get_sample_value(
        "kvferry_tier_ops_total", {"tier": tier.name, "op": op, "result": result}
    )
    return value or 0.0


@pytest.fixture
def tier(tmp_path: Path):
    tier = DiskTier(tmp_path / "cache", 64 << 20, workers=2, name=f"disk-test-{tmp_path.name}")
    yield tier
    tier.close()


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.uint8])
@pytest.mark.parametrize("shape", [SHAPE, ODD_SHAPE])
def test_round_trip_bit_exact(tmp_path: Path, direct: bool, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tier = DiskTier(tmp_path, 16 << 20, workers=2, direct=direct)
    try:
        assert tier.direct is direct
        obj = random_tensor(shape, dtype, seed=11)
        assert tier.put(key(1), obj).result()
        aligned = AlignedAlloc()
        assert same_bits(tier.get(key(1), aligned).result(), obj)  # zero-copy O_DIRECT path
        assert same_bits(tier.get(key(1), plain_alloc).result(), obj)  # unaligned: bounce buffer
        assert tier.get(key(2), aligned).result() is None
        assert aligned.allocated == 1
    finally:
        tier.close()


def test_put_reports_stored_then_exists_and_metrics(tier: DiskTier) -> None:
    obj = random_tensor(SHAPE, torch.bfloat16, seed=1)
    assert tier.put(key(1), obj).result() and tier.put(key(1), obj).result()
    stats = tier.stats()
    assert stats["ops"]["put"] == {"stored": 1, "exists": 1}
    assert stats["used_bytes"] == FILE_BYTES and stats["objects"] == 1
    assert _metric(tier, "put", "stored") == 1
    assert tier.contains(key(1)) and not tier.contains(key(2))
    assert tier.contains_many([key(2), key(1)]) == [False, True]


def test_restart_finds_objects_and_keeps_lru_order(tmp_path: Path) -> None:
    objs = [random_tensor(SHAPE, torch.bfloat16, seed=i) for i in range(3)]
    first = DiskTier(tmp_path, 3 * FILE_BYTES)
    for i, obj in enumerate(objs):
        assert first.put(key(i), obj).result()
    assert first.get(key(0), plain_alloc).result() is not None  # 0 is now the most recent
    first.close()

    second = DiskTier(tmp_path, 3 * FILE_BYTES)
    try:
        assert second.used_bytes == 3 * FILE_BYTES and second.contains_many([key(i) for i in range(3)]) == [True] * 3
        assert second.put(key(3), random_tensor(SHAPE, torch.bfloat16, seed=3)).result()
        assert second.contains_many([key(i) for i in range(4)]) == [True, False, True, True]
        assert same_bits(second.get(key(0), plain_alloc).result(), objs[0])
    finally:
        second.close()


def test_capacity_evicts_least_recently_used(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 3 * FILE_BYTES, workers=1)
    try:
        for i in range(3):
            assert tier.put(key(i), random_tensor(SHAPE, torch.bfloat16, seed=i)).result()
        assert tier.get(key(0), plain_alloc).result() is not None
        assert tier.put(key(3), random_tensor(SHAPE, torch.bfloat16, seed=3)).result()
        assert tier.contains_many([key(i) for i in range(4)]) == [True, False, True, True]
        assert len(_files(tmp_path)) == 3 and tier.used_bytes == 3 * FILE_BYTES
        assert tier.stats()["evictions"] == 1
        assert tier.evict(1) == FILE_BYTES and not tier.contains(key(2))  # next in LRU order
        assert len(_files(tmp_path)) == 2
    finally:
        tier.close()


def test_object_larger_than_capacity_is_refused(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, FILE_BYTES - 1)
    try:
        assert tier.put(key(1), random_tensor(SHAPE, torch.bfloat16, seed=1)).result() is False
        assert tier.stats()["ops"]["put"] == {"full": 1} and tier.healthy and not _files(tmp_path)
    finally:
        tier.close()


def test_truncated_file_is_a_miss_and_deleted(tier: DiskTier) -> None:
    assert tier.put(key(1), random_tensor(SHAPE, torch.bfloat16, seed=1)).result()
    (path,) = _files(Path(tier.root))
    os.truncate(path, FILE_BYTES - 4096)
    alloc = AlignedAlloc()
    assert tier.get(key(1), alloc, alloc.free).result() is None
    assert not path.exists() and not tier.contains(key(1)) and tier.used_bytes == 0
    assert alloc.allocated == 0  # caught from the header and the file size, before any allocation
    assert _metric(tier, "get", "corrupt") == 1


def test_corrupted_byte_is_a_miss_deleted_and_its_memory_freed(tier: DiskTier) -> None:
    assert tier.put(key(1), random_tensor(ODD_SHAPE, torch.float16, seed=1)).result()
    (path,) = _files(Path(tier.root))
    _flip_byte(path, 4096 + 5000)
    alloc = AlignedAlloc()
    assert tier.get(key(1), alloc, alloc.free).result() is None
    assert (alloc.allocated, alloc.freed) == (1, 1) and not path.exists()


def test_corrupt_object_returns_its_memory_to_the_host_pool(tier: DiskTier) -> None:
    pool = HostPool(1 << 20, pin=False)
    obj = random_tensor(SHAPE, torch.bfloat16, seed=1)
    assert tier.put(key(1), obj).result()
    hit = tier.get(key(1), pool.try_alloc, pool.free).result()
    assert same_bits(hit, obj) and pool.used_bytes == obj.nbytes
    pool.free(hit)
    (path,) = _files(Path(tier.root))
    _flip_byte(path, 4096 + 100)
    assert tier.get(key(1), pool.try_alloc, pool.free).result() is None
    assert pool.used_bytes == 0 and not path.exists()


def test_pool_full_is_a_miss_that_keeps_the_object(tier: DiskTier) -> None:
    assert tier.put(key(1), random_tensor(SHAPE, torch.bfloat16, seed=1)).result()
    assert tier.get(key(1), lambda shape, dtype: None).result() is None
    assert tier.contains(key(1)) and tier.stats()["ops"]["get"] == {"no_memory": 1}


def test_wrong_tensor_from_alloc_is_a_counted_error_not_a_crash(tier: DiskTier) -> None:
    assert tier.put(key(1), random_tensor(SHAPE, torch.bfloat16, seed=1)).result()
    alloc = AlignedAlloc()

    def wrong(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return alloc((7,), dtype)

    assert tier.get(key(1), wrong, alloc.free).result() is None
    assert alloc.freed == 1 and tier.stats()["ops"]["get"] == {"error": 1} and tier.contains(key(1))


def test_bad_arguments_raise_at_once(tier: DiskTier) -> None:
    with pytest.raises(ValueError, match="contiguous"):
        tier.put(key(1), torch.zeros(8, 8).t())
    with pytest.raises(TypeError, match="key must be non-empty bytes"):
        tier.get("k", plain_alloc)
    with pytest.raises(ValueError, match="capacity_bytes must be positive"):
        DiskTier(tier.root, 0)


def test_full_filesystem_degrades_to_misses(tmpfs_dir: Path) -> None:
    """A real 1 MiB tmpfs: a 2 MiB put fails with ENOSPC -> False; small objects still work."""
    tier = DiskTier(tmpfs_dir, 1 << 30, name=f"tmpfs-{tmpfs_dir}")
    try:
        big = random_tensor((2, 1, 256, 2048), torch.uint8, seed=1)
        assert tier.put(key("big"), big).result() is False
        assert tier.healthy and _metric(tier, "put", "full") == 1
        assert not list(tmpfs_dir.rglob("*.tmp")) and tier.used_bytes == 0
        assert tier.get(key("big"), plain_alloc).result() is None
        small = random_tensor(ODD_SHAPE, torch.float16, seed=2)
        assert tier.put(key("small"), small).result()
        assert same_bits(tier.get(key("small"), plain_alloc).result(), small)
    finally:
        tier.close()


def test_enospc_midway_cleans_up_and_stays_healthy(tier: DiskTier, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same degradation where no tmpfs can be mounted: the write fails half way with ENOSPC."""
    real_write = disk_module.write_object

    def half_then_enospc(path: str, header: bytes, payload: memoryview, **kwargs: bool) -> None:
        real_write(path, header, payload[: len(payload) // 2], **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_module, "write_object", half_then_enospc)
    assert tier.put(key(1), random_tensor(SHAPE, torch.bfloat16, seed=1)).result() is False
    assert tier.healthy and tier.stats()["ops"]["put"] == {"full": 1} and tier.used_bytes == 0
    assert not list(Path(tier.root).rglob("*.tmp")) and not _files(Path(tier.root))


def test_broken_directory_marks_unhealthy_then_recovers(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    tier = DiskTier(root, 1 << 20, backoff_s=0.05, backoff_max_s=0.05)
    try:
        obj = random_tensor(ODD_SHAPE, torch.float16, seed=1)
        shutil.rmtree(root)
        root.write_bytes(b"not a directory")
        assert tier.put(key(1), obj).result() is False
        assert not tier.healthy
        assert tier.put(key(1), obj).result() is False  # skipped, not attempted
        assert tier.get(key(1), plain_alloc).result() is None and not tier.contains(key(1))
        assert tier.stats()["ops"]["put"]["unavailable"] == 2
        root.unlink()
        root.mkdir()
        time.sleep(0.06)
        assert tier.put(key(1), obj).result() and tier.healthy
    finally:
        tier.close()


def test_check_finds_an_idle_tier_broken_and_then_whole(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    tier = DiskTier(root, 1 << 20, backoff_s=0.05, backoff_max_s=0.05)
    try:
        assert tier.check() and tier.stats()["ops"] == {}  # a probe is no operation on objects
        shutil.rmtree(root)
        root.write_bytes(b"not a directory")
        assert not tier.check() and not tier.healthy
        root.unlink()
        root.mkdir()
        time.sleep(0.06)
        assert tier.check() and tier.healthy
    finally:
        tier.close()


def test_a_directory_that_cannot_be_written_is_refused_at_once(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(TierURLError, match="cannot be created"):
        make_tier(f"disk:{tmp_path}/file/sub?size=1MB")
    with pytest.raises(TierURLError, match="is not writable"):
        make_tier("disk:/proc/self?size=1MB")  # exists; no files can be made there, even by root


def test_stale_temp_files_are_removed_at_start(tmp_path: Path) -> None:
    sub = tmp_path / "ab"
    sub.mkdir()
    stale, fresh = sub / "x.kvf.1.2.tmp", sub / "y.kvf.3.4.tmp"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    DiskTier(tmp_path, 1 << 20).close()
    assert not stale.exists() and fresh.exists()


def test_second_instance_on_the_same_directory_adopts_files(tmp_path: Path) -> None:
    writer, reader = DiskTier(tmp_path, 1 << 20), DiskTier(tmp_path, 1 << 20)
    try:
        obj = random_tensor(SHAPE, torch.bfloat16, seed=5)
        assert writer.put(key(1), obj).result()
        assert reader.used_bytes == 0 and reader.contains(key(1)) and reader.used_bytes == FILE_BYTES
        assert reader.put(key(1), obj).result() and reader.stats()["ops"]["put"] == {"exists": 1}
        assert same_bits(reader.get(key(1), plain_alloc).result(), obj)
    finally:
        writer.close()
        reader.close()


def test_concurrent_puts_of_one_key_write_it_once(tier: DiskTier) -> None:
    obj = random_tensor(SHAPE, torch.bfloat16, seed=1)
    futures = []
    threads = [threading.Thread(target=lambda: futures.append(tier.put(key(1), obj))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(f.result() for f in futures)
    assert tier.used_bytes == FILE_BYTES and len(_files(Path(tier.root))) == 1


def test_close_finishes_queued_writes(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 16 << 20, workers=1)
    futures = [tier.put(key(i), random_tensor(SHAPE, torch.bfloat16, seed=i)) for i in range(12)]
    tier.close()
    assert all(f.done() and f.result() for f in futures) and len(_files(tmp_path)) == 12
    assert tier.put(key(99), random_tensor(SHAPE, torch.bfloat16, seed=9)).result() is False

"""Objects stored by one OS process are read back bit-exact by another, through every kind of tier."""

import multiprocessing
from pathlib import Path

import pytest
import torch

from kvferry.tiers import make_tier
from tests.tiers.tierkit import AlignedAlloc, key, random_tensor, same_bits, store_objects

SPECS = [
    ("bf16", (2, 4, 256, 64), "bfloat16", 1),
    ("fp16", (2, 2, 128, 96), "float16", 2),
    ("u8", (1, 3, 256, 132), "uint8", 3),
]


def _store_in_child_then_read_here(urls: list[str]) -> None:
    child = multiprocessing.get_context("spawn").Process(target=store_objects, args=(urls, SPECS))
    child.start()
    child.join(120)
    assert child.exitcode == 0

    for url in urls:
        tier = make_tier(url)
        try:
            alloc = AlignedAlloc()
            for name, shape, dtype, seed in SPECS:
                expected = random_tensor(shape, getattr(torch, dtype), seed)
                assert same_bits(tier.get(key(name), alloc).result(), expected), (url, name)
        finally:
            tier.close()


def test_shared_disk_directory(tmp_path: Path) -> None:
    _store_in_child_then_read_here([f"disk:{tmp_path}/shared?size=64MiB"])


@pytest.mark.redis
def test_shared_redis_standalone_and_cluster(redis_url: str, cluster_url: str) -> None:
    _store_in_child_then_read_here([redis_url, cluster_url])

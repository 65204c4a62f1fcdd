from pathlib import Path

import pytest
import torch

from kvferry.tiers import DiskTier, TierChain
from tests.tiers.tierkit import AlignedAlloc, key, plain_alloc, random_tensor, same_bits

SHAPE = (2, 1, 32, 64)


@pytest.fixture
def chain(tmp_path: Path):
    upper = DiskTier(tmp_path / "upper", 1 << 20, name=f"upper-{tmp_path.name}")
    lower = DiskTier(tmp_path / "lower", 1 << 20, name=f"lower-{tmp_path.name}")
    chain = TierChain([upper, lower])
    yield chain
    chain.close()


def test_put_reaches_every_tier(chain: TierChain) -> None:
    obj = random_tensor(SHAPE, torch.bfloat16, seed=1)
    assert chain.put(key(1), obj).result()
    assert [tier.contains(key(1)) for tier in chain.tiers] == [True, True]
    assert [s["ops"]["put"] for s in chain.stats()] == [{"stored": 1}, {"stored": 1}]


def test_get_falls_through_to_the_first_tier_that_has_it(chain: TierChain) -> None:
    upper, lower = chain.tiers
    obj = random_tensor(SHAPE, torch.float16, seed=2)
    assert lower.put(key(1), obj).result()
    alloc = AlignedAlloc()
    assert same_bits(chain.get(key(1), alloc, alloc.free).result(), obj)
    assert upper.stats()["ops"]["get"] == {"miss": 1} and lower.stats()["ops"]["get"] == {"hit": 1}
    assert chain.get(key(2), alloc).result() is None
    assert alloc.allocated == 1


def test_contains_many_asks_lower_tiers_only_for_what_is_missing(chain: TierChain) -> None:
    upper, lower = chain.tiers
    assert upper.put(key(1), random_tensor(SHAPE, torch.uint8, seed=1)).result()
    assert lower.put(key(2), random_tensor(SHAPE, torch.uint8, seed=2)).result()
    assert chain.contains_many([key(1), key(2), key(3)]) == [True, True, False]
    assert chain.contains(key(2)) and not chain.contains(key(3))
    chain.delete(key(2))
    assert not chain.contains(key(2))


def test_put_is_done_only_when_every_tier_is(chain: TierChain) -> None:
    upper, lower = chain.tiers
    lower.close()  # refuses writes now
    future = chain.put(key(1), random_tensor(SHAPE, torch.uint8, seed=1))
    assert future.result() is True and upper.contains(key(1))


def test_empty_chain_and_duplicate_names(tmp_path: Path) -> None:
    empty = TierChain([])
    assert empty.put(key(1), random_tensor(SHAPE, torch.uint8, seed=1)).result() is False
    assert empty.get(key(1), plain_alloc).result() is None
    tier = DiskTier(tmp_path, 1 << 20)
    try:
        with pytest.raises(ValueError, match="distinct names"):
            TierChain([tier, tier])
    finally:
        tier.close()

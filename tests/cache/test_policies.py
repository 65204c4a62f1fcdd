"""Eviction order of each policy, pinned keys passed over in place, and the factory."""

from __future__ import annotations

import pytest

from kvferry.cache.policies import POLICIES, LRUPolicy, S3FIFOPolicy, make_policy


def _k(i: int) -> bytes:
    return i.to_bytes(32, "little")


def _any(_: bytes) -> bool:
    return True


def test_lru_evicts_least_recently_used_first() -> None:
    policy = LRUPolicy()
    for i in range(5):
        policy.insert(_k(i))
    policy.touch(_k(0))
    policy.touch(_k(2))
    assert policy.evict(3, _any) == [_k(1), _k(3), _k(4)]
    assert policy.evict(5, _any) == [_k(0), _k(2)]
    assert len(policy) == 0


def test_lru_passes_over_pinned_keys_in_place() -> None:
    policy = LRUPolicy()
    for i in range(4):
        policy.insert(_k(i))
    pinned = {_k(0), _k(1)}
    assert policy.evict(1, lambda k: k not in pinned) == [_k(2)]
    # Unpinned again, 0 and 1 are still the oldest: pinning did not refresh them.
    assert policy.evict(2, _any) == [_k(0), _k(1)]


def test_lru_returns_fewer_when_nothing_else_is_evictable() -> None:
    policy = LRUPolicy()
    for i in range(3):
        policy.insert(_k(i))
    assert policy.evict(3, lambda k: k == _k(1)) == [_k(1)]
    assert policy.evict(3, lambda k: False) == []
    assert len(policy) == 2


def test_lru_rejects_double_insert_and_ignores_unknown_keys() -> None:
    policy = LRUPolicy()
    policy.insert(_k(1))
    with pytest.raises(KeyError):
        policy.insert(_k(1))
    policy.touch(_k(9))
    policy.remove(_k(9))
    policy.remove(_k(1))
    assert _k(1) not in policy


def test_s3fifo_one_hit_keys_leave_before_reused_ones() -> None:
    policy = S3FIFOPolicy(small_ratio=0.1)
    for i in range(10):
        policy.insert(_k(i))
    for i in (0, 3, 6):  # accessed once more: they earn a place in the main queue
        policy.touch(_k(i))
    victims = policy.evict(7, _any)
    assert victims == [_k(i) for i in (1, 2, 4, 5, 7, 8, 9)]
    assert all(policy.queue_of(_k(i)) == "main" for i in (0, 3, 6))
    assert all(policy.queue_of(v) == "ghost" for v in victims)


def test_s3fifo_ghost_hit_goes_straight_to_main() -> None:
    policy = S3FIFOPolicy()
    policy.insert(_k(1))
    policy.insert(_k(2))
    assert policy.evict(1, _any) == [_k(1)]
    policy.insert(_k(1))
    assert policy.queue_of(_k(1)) == "main"
    assert policy.queue_of(_k(2)) == "small"


def test_s3fifo_main_queue_is_a_clock() -> None:
    policy = S3FIFOPolicy(small_ratio=0.5)
    for i in range(4):  # ghost-readmit 0..3 so they all live in main
        policy.insert(_k(i))
    policy.evict(4, _any)
    for i in range(4):
        policy.insert(_k(i))
    assert all(policy.queue_of(_k(i)) == "main" for i in range(4))
    policy.touch(_k(0))
    policy.touch(_k(0))
    policy.touch(_k(1))
    # 0 has two lives and 1 one: the scan decrements them and takes 2, 3, then 1, then 0.
    assert policy.evict(4, _any) == [_k(2), _k(3), _k(1), _k(0)]


def test_s3fifo_passes_over_pinned_keys_and_terminates() -> None:
    policy = S3FIFOPolicy()
    for i in range(6):
        policy.insert(_k(i))
    policy.touch(_k(5))
    assert policy.evict(10, lambda k: False) == []
    assert len(policy) == 6
    pinned = {_k(0), _k(1)}
    assert policy.evict(2, lambda k: k not in pinned) == [_k(2), _k(3)]
    assert policy.queue_of(_k(0)) == "small"  # kept its place at the front
    assert policy.evict(1, _any) == [_k(0)]


def test_s3fifo_ghost_is_bounded() -> None:
    policy = S3FIFOPolicy()
    for i in range(100):
        policy.insert(_k(i))
        if len(policy) > 4:
            policy.evict(1, _any)
    ghosts = [i for i in range(100) if policy.queue_of(_k(i)) == "ghost"]
    assert ghosts == list(range(91, 96))  # the 5 most recent victims: the most keys ever held at once


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_factory_builds_each_policy(name: str) -> None:
    policy = make_policy(name)
    assert policy.name == name and len(policy) == 0


def test_factory_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match=r"'arc'.*lru"):
        make_policy("arc")
    with pytest.raises(ValueError, match="small_ratio"):
        S3FIFOPolicy(small_ratio=1.5)


@pytest.mark.parametrize("name", ["lru", "s3fifo"])
def test_a_demoted_key_is_the_next_victim(name: str) -> None:
    policy = make_policy(name)
    for i in range(6):
        policy.insert(_k(i))
    for i in range(6):
        policy.touch(_k(i))  # every key reused: none is a one-hit key
    policy.demote(_k(4))
    policy.demote(_k(99))  # unknown: ignored
    assert policy.evict(1, _any) == [_k(4)]
    assert len(policy) == 5 and _k(4) not in policy

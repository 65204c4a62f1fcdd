"""LOCATE through a real ``kvferry server --shared-pool``: an engine's process maps the server's pool and copies a
prefix's objects itself, bit-exact with a RETRIEVE of the same prefix; the lease is the client's to end, outlives
its session, and a private pool is refused. A LOOKUP with ``locate`` answers as LOCATE does (its lock the lease), and
where LOCATE would refuse, as a plain locked LOOKUP."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

import kvferry
from kvferry.client import KvferryClient, ServerError
from kvferry.client.pool_map import PoolMapping
from kvferry.formats import describe
from tests.server.serverkit import (
    FMT_REAL,
    PER_CHUNK,
    REAL_BS,
    REAL_CHUNK,
    REAL_NS,
    ServerProcess,
    blocks,
    real_kv,
)


@pytest.fixture(scope="module")
def shared_server() -> Iterator[ServerProcess]:
    server = ServerProcess("--shared-pool", "--chunk-size", str(REAL_CHUNK), "--l1-size-gb", "0.0625", ipc=True)
    yield server
    server.stop()


def test_located_objects_copied_here_equal_a_retrieve(shared_server: ServerProcess) -> None:
    tokens = list(range(1000, 1000 + 3 * REAL_CHUNK + 2 * REAL_BS))  # three chunks and a two-block tail
    src, by_retrieve, by_locate = real_kv(1), real_kv(2), real_kv(3)
    n_blocks = 3 * PER_CHUNK + 2
    src_ids, dst_ids = list(range(10, 10 + n_blocks)), list(range(50, 50 + n_blocks))
    with KvferryClient(shared_server.ipc_endpoint or shared_server.endpoint) as client:
        reg = client.register_kv_cache(src, FMT_REAL, namespace=REAL_NS)
        assert client.store(reg, tokens, src_ids, tail=True) == len(tokens)
        other = client.register_kv_cache(by_retrieve, FMT_REAL, namespace=REAL_NS)
        assert client.retrieve(other, tokens, dst_ids) == len(tokens)
        located = client.locate_async(tokens, registration=reg, block_size=REAL_BS).result(timeout=10)
        assert located.tokens == len(tokens) and located.lease is not None and located.deadline > time.monotonic()
        assert [n for _, n in located.objects] == [REAL_CHUNK] * 3 + [2 * REAL_BS]
        pid, fd, nbytes = located.pool
        assert pid == shared_server.pid
        pool = PoolMapping(pid, fd, nbytes, pin=False)
        geom = describe(FMT_REAL, by_locate, block_size=REAL_BS)
        views = [pool.object_at(o, geom.object_shape(n), geom.object_dtype) for o, n in located.objects]
        kvferry.transfer(by_locate, views, dst_ids, kvferry.Direction.H2D, FMT_REAL, REAL_CHUNK)
        assert client.stats()["cache"]["read_leases"] == 1
        assert client.free_lookup_locks(located.lease)
        assert client.stats()["cache"]["read_leases"] == 0
    assert torch.equal(blocks(by_locate, dst_ids), blocks(src, src_ids))
    assert torch.equal(blocks(by_locate, dst_ids), blocks(by_retrieve, dst_ids))


def test_a_located_lookup_answers_as_locate_its_lock_the_lease(shared_server: ServerProcess) -> None:
    tokens = list(range(3000, 3000 + 2 * REAL_CHUNK + REAL_BS))
    with KvferryClient(shared_server.endpoint) as client:
        reg = client.register_kv_cache(real_kv(6), FMT_REAL, namespace=REAL_NS)
        assert client.store(reg, tokens, list(range(2 * PER_CHUNK + 1)), tail=True) == len(tokens)
        located = client.locate_async(tokens, registration=reg, block_size=REAL_BS).result(timeout=10)
        found = client.lookup(tokens, registration=reg, lock=True, block_size=REAL_BS, locate=True)
        assert found.located is not None and found.lock == found.located.lease is not None
        assert (found.tokens, found.located.tokens) == (len(tokens), len(tokens))
        assert (found.located.objects, found.located.pool) == (located.objects, located.pool)
        assert client.stats()["cache"]["read_leases"] == 2  # LOCATE's and the lookup's
        assert client.free_lookup_locks_many_async([found.lock, located.lease]).result(timeout=10) == 2
        assert client.stats()["cache"]["read_leases"] == 0
        windowed = client.lookup(tokens, registration=reg, lock=True, first_chunk=1, locate=True)
        assert windowed.located is None and windowed.lock is not None  # a window's hit is not located: locked
        assert client.free_lookup_locks(windowed.lock)


def test_a_lease_outlives_its_session_and_a_miss_holds_nothing(shared_server: ServerProcess) -> None:
    """A client that goes away may have copies running in a process still alive: its leases end at their
    deadline (or when freed), not with its session."""
    tokens = list(range(5000, 5000 + REAL_CHUNK))
    with KvferryClient(shared_server.endpoint) as client:
        reg = client.register_kv_cache(real_kv(4), FMT_REAL, namespace=REAL_NS)
        client.store(reg, tokens, list(range(PER_CHUNK)))
        assert client.locate_async(tokens, registration=reg).result(timeout=10).lease is not None
        assert client.lookup(tokens, registration=reg, lock=True, locate=True).located is not None
        missed = client.locate_async(list(range(9000, 9000 + REAL_CHUNK)), registration=reg).result(timeout=10)
        assert (missed.tokens, missed.lease, missed.objects) == (0, None, [])
        missed_lookup = client.lookup(list(range(9000, 9000 + REAL_CHUNK)), registration=reg, lock=True, locate=True)
        assert (missed_lookup.tokens, missed_lookup.lock, missed_lookup.located) == (0, None, None)
    with KvferryClient(shared_server.endpoint) as watcher:
        assert watcher.stats()["cache"]["read_leases"] == 2
        watcher.clear()  # drops the objects, not the leases' hold on their memory
        assert watcher.stats()["cache"]["read_leases"] == 2


def test_a_private_pool_refuses_locate_and_a_located_lookup_only_locks() -> None:
    server = ServerProcess("--chunk-size", str(REAL_CHUNK), "--l1-size-gb", "0.0625")
    try:
        with KvferryClient(server.endpoint) as client:
            reg = client.register_kv_cache(real_kv(5), FMT_REAL, namespace=REAL_NS)
            with pytest.raises(ServerError, match=r"BAD_ARGUMENT.*not shared"):
                client.locate_async(list(range(REAL_CHUNK)), registration=reg).result(timeout=10)
            client.store(reg, list(range(REAL_CHUNK)), list(range(PER_CHUNK)))
            found = client.lookup(list(range(REAL_CHUNK)), registration=reg, lock=True, locate=True)
            assert (found.tokens, found.located) == (REAL_CHUNK, None) and found.lock is not None
            assert client.stats()["cache"]["read_leases"] == 0 and client.free_lookup_locks(found.lock)
    finally:
        assert server.stop() == 0

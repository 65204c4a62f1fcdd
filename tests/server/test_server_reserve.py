"""RESERVE and COMMIT through a real ``kvferry server --shared-pool``: an engine's process maps the server's pool,
copies a store's chunks and tail into objects reserved for it, and commits them; a RETRIEVE then loads them
bit-exact. Objects not reserved for the committing session are refused, a session's reserved objects are freed a
heartbeat timeout after it ends, and a private pool refuses RESERVE."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

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
    wait_for,
)


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    config = Path(tmp_path_factory.mktemp("reserve")) / "server.yaml"
    config.write_text("server:\n  heartbeat_interval_s: 0.2\n  heartbeat_timeout_s: 1.0\n")
    flags = ("--config", str(config), "--shared-pool", "--chunk-size", str(REAL_CHUNK), "--l1-size-gb", "0.0625")
    server = ServerProcess(*flags, ipc=True)
    yield server
    server.stop()


def write_store(
    client: KvferryClient, reg: int, src: list[torch.Tensor], src_ids: list[int], n_chunks: int, tail: int
) -> list[int]:
    """Reserve objects and copy ``n_chunks`` chunks of ``src_ids``' blocks (and ``tail`` tokens after them) into
    them through this process's mapping of the pool, as a direct store does; returns the objects written."""
    reserved = client.reserve_async(reg, n_chunks + (tail > 0)).result(timeout=10)
    assert reserved.pool is not None and len(reserved.objects) == n_chunks + (tail > 0)
    pool = PoolMapping(*reserved.pool, pin=False)
    geom = describe(FMT_REAL, src, block_size=REAL_BS)
    views = [pool.object_at(o, geom.object_shape(REAL_CHUNK), geom.object_dtype) for o in reserved.objects[:n_chunks]]
    kvferry.transfer(src, views, src_ids[: n_chunks * PER_CHUNK], kvferry.Direction.D2H, FMT_REAL, REAL_CHUNK)
    if tail:
        tail_view = pool.object_at(reserved.objects[-1], geom.object_shape(tail), geom.object_dtype)
        tail_ids = src_ids[n_chunks * PER_CHUNK : n_chunks * PER_CHUNK + tail // REAL_BS]
        kvferry.transfer(src, [tail_view], tail_ids, kvferry.Direction.D2H, FMT_REAL, tail)
    return reserved.objects


def test_committed_objects_load_as_stored_ones(shared_server: ServerProcess) -> None:
    tokens = list(range(1000, 1000 + 3 * REAL_CHUNK + 2 * REAL_BS + 3))  # three chunks, a two-block tail, 3 more
    src, dst = real_kv(1), real_kv(2)
    n_blocks = 3 * PER_CHUNK + 2
    src_ids, dst_ids = list(range(10, 10 + n_blocks)), list(range(50, 50 + n_blocks))
    with KvferryClient(shared_server.ipc_endpoint or shared_server.endpoint) as client:
        reg = client.register_kv_cache(src, FMT_REAL, namespace=REAL_NS)
        written = write_store(client, reg, src, src_ids, 3, 2 * REAL_BS)
        assert client.lookup(tokens, registration=reg).tokens == 0  # reserved objects are nobody's hits
        committed = client.commit_async(reg, tokens, written[:3], tail=(written[3], 2 * REAL_BS), refill=2).result(
            timeout=10
        )
        assert committed.stored == 3 * REAL_CHUNK + 2 * REAL_BS and len(committed.objects) == 2
        other = client.register_kv_cache(dst, FMT_REAL, namespace=REAL_NS)
        assert client.retrieve(other, tokens, dst_ids) == 3 * REAL_CHUNK + 2 * REAL_BS
        assert client.stats()["cache"]["stored_chunks"] == 4
    assert torch.equal(blocks(dst, dst_ids), blocks(src, src_ids))


def test_a_commit_names_only_its_sessions_reserved_objects_once(shared_server: ServerProcess) -> None:
    tokens = list(range(7000, 7000 + REAL_CHUNK))
    src = real_kv(3)
    endpoint = shared_server.ipc_endpoint or shared_server.endpoint
    with KvferryClient(endpoint) as client, KvferryClient(endpoint) as other:
        reg = client.register_kv_cache(src, FMT_REAL, namespace=REAL_NS)
        other_reg = other.register_kv_cache(real_kv(4), FMT_REAL, namespace=REAL_NS)
        mine = write_store(client, reg, src, list(range(PER_CHUNK)), 1, 0)
        with pytest.raises(ServerError, match=r"BAD_ARGUMENT.*not objects reserved for the sending session"):
            other.commit_async(other_reg, tokens, mine).result(timeout=10)
        with pytest.raises(ServerError, match=r"BAD_ARGUMENT.*COMMIT: 1 objects for chunks 0..1"):
            client.commit_async(reg, tokens * 2, mine).result(timeout=10)  # still its own after a refusal
        assert client.commit_async(reg, tokens, mine).result(timeout=10).stored == REAL_CHUNK
        with pytest.raises(ServerError, match=r"BAD_ARGUMENT.*not objects reserved"):
            client.commit_async(reg, tokens, mine).result(timeout=10)  # committed already
        assert client.lookup(tokens, registration=reg).tokens == REAL_CHUNK


def test_an_ended_sessions_reserved_objects_are_freed_after_a_heartbeat_timeout(shared_server: ServerProcess) -> None:
    endpoint = shared_server.ipc_endpoint or shared_server.endpoint

    def used(client: KvferryClient) -> int:
        return int(client.stats()["cache"]["pool"]["used_bytes"])

    kv = real_kv(5)
    geom = describe(FMT_REAL, kv, block_size=REAL_BS)
    object_bytes = torch.Size(geom.object_shape(REAL_CHUNK)).numel() * geom.object_dtype.itemsize
    with KvferryClient(endpoint) as watcher:
        with KvferryClient(endpoint) as client:
            reg = client.register_kv_cache(kv, FMT_REAL, namespace=REAL_NS)
            assert len(client.reserve_async(reg, 3).result(timeout=10).objects) == 3
            held = used(watcher)  # with them (and maybe objects of earlier tests' sessions, freed meanwhile)
        ended = time.monotonic()
        wait_for(lambda: used(watcher) <= held - 3 * object_bytes, "the ended session's objects freed", 10)
        assert time.monotonic() - ended > 0.5  # not at once: its process might still be copying


def test_a_private_pool_refuses_reserve() -> None:
    server = ServerProcess("--chunk-size", str(REAL_CHUNK), "--l1-size-gb", "0.0625")
    try:
        with KvferryClient(server.endpoint) as client:
            reg = client.register_kv_cache(real_kv(6), FMT_REAL, namespace=REAL_NS)
            with pytest.raises(ServerError, match=r"BAD_ARGUMENT.*not shared"):
                client.reserve_async(reg, 1).result(timeout=10)
    finally:
        assert server.stop() == 0

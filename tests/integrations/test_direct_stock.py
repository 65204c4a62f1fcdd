"""`DirectStores`' stock of reserved objects, against stand-ins for RESERVE and COMMIT over a shared pool of this
process: it grows to twice the largest store, a COMMIT brings as many back, a new session drops the old one's, a
refusal turns direct stores off (said once), and a failed COMMIT fails the store."""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from kvferry.cache.keys import TokenIds
from kvferry.client import ServerError
from kvferry.client.pool_map import MappedPool
from kvferry.client.records import Reserved
from kvferry.connector.direct_stores import DirectStores
from kvferry.connector.engine_kv import EngineKV
from kvferry.formats import EngineKVFormat as F
from kvferry.formats import describe
from kvferry.memory import HostPool
from kvferry.transfer import Direction, transfer

BS, CHUNK, NB = 4, 8, 32


class FakeServer:
    """RESERVE and COMMIT of a server whose pool is ``pool`` (shared), handing out whole-chunk objects."""

    def __init__(self, kv: EngineKV) -> None:
        geom = describe(kv.fmt, kv.paged, kv.block_size)
        self.shape, self.dtype = geom.object_shape(CHUNK), geom.object_dtype
        self.pool = HostPool(1 << 20, pin=False, shared=True)
        self.committed: list[tuple[list[int], int, list[int], tuple[int, int] | None]] = []
        self.fail: BaseException | None = None

    def file(self) -> tuple[int, int, int]:
        fd = self.pool.shared_fd
        assert fd is not None
        return os.getpid(), fd, self.pool.capacity_bytes

    def reserve(self, count: int) -> Future[Reserved]:
        done: Future[Reserved] = Future()
        if self.fail is not None:
            done.set_exception(self.fail)
        else:
            base = self.pool.slab.data_ptr()
            offsets = [a - base for a in self.pool.try_reserve_many(self.shape, self.dtype, count)]
            done.set_result(Reserved(offsets, 0, self.file()))
        return done

    def commit(
        self, tokens: TokenIds, first: int, objects: list[int], tail: tuple[int, int] | None, refill: int
    ) -> Future[Reserved]:
        if self.fail is not None:
            failed: Future[Reserved] = Future()
            failed.set_exception(self.fail)
            return failed
        self.committed.append((list(tokens), first, objects, tail))
        more = self.reserve(refill).result() if refill else Reserved([], 0, None)
        done: Future[Reserved] = Future()
        done.set_result(Reserved(more.objects, len(objects) * CHUNK, None))
        return done


@pytest.fixture
def kv() -> EngineKV:
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    paged = [torch.randn(2, NB, BS, 2, 8) for _ in range(2)]
    return EngineKV(fmt, paged, list(paged), ["0", "1"], BS, "float32")


def settled(stores: DirectStores) -> None:
    """What the stores' thread was handed (a RESERVE's answer) has run."""
    stores._rest.submit(lambda: None).result(timeout=10)


def test_the_stock_grows_to_twice_the_largest_store_and_a_commit_refills_it(kv: EngineKV) -> None:
    server = FakeServer(kv)
    stores = DirectStores(kv, MappedPool(pin=False), 10, lambda exc: isinstance(exc, ServerError))
    tokens = list(range(3 * CHUNK))
    assert stores.start(tokens, list(range(6)), 0, CHUNK, 7, server.commit) is None  # nothing reserved: STORE
    stores.refill(7, server.reserve)
    settled(stores)
    assert stores.stocked == 6
    assert stores.start(tokens, list(range(6)), 0, CHUNK, 7, server.commit).result(timeout=10) == 3 * CHUNK
    assert stores.stocked == 6 and len(server.committed) == 1
    _, first, objects, tail = server.committed[0]
    assert (first, len(objects), tail) == (0, 3, None)
    geom = describe(kv.fmt, kv.paged, kv.block_size)
    want = torch.empty(geom.object_shape(CHUNK), dtype=geom.object_dtype)
    transfer(kv.paged, [want], [2, 3], Direction.D2H, kv.fmt, CHUNK, backend="torch")  # chunk 1's blocks
    nbytes = want.numel() * want.element_size()
    got = server.pool.slab[objects[1] : objects[1] + nbytes].view(geom.object_dtype).view(want.shape)
    assert torch.equal(got, want)
    stores.refill(8, server.reserve)  # a new session: the old one's objects went with it
    assert stores.stocked == 0
    stores.close()


def stocked_for_one_chunk(kv: EngineKV) -> tuple[FakeServer, DirectStores]:
    """Direct stores of session 1 whose first one-chunk store went through STORE and had two objects reserved."""
    server = FakeServer(kv)
    stores = DirectStores(kv, MappedPool(pin=False), 10, lambda exc: isinstance(exc, ServerError))
    assert stores.start(list(range(CHUNK)), [0, 1], 0, CHUNK, 1, server.commit) is None
    stores.refill(1, server.reserve)
    settled(stores)
    assert stores.stocked == 2
    return server, stores


def test_a_refusal_turns_direct_stores_off_and_a_failed_commit_fails_the_store(
    kv: EngineKV, caplog: pytest.LogCaptureFixture
) -> None:
    server, stores = stocked_for_one_chunk(kv)
    tokens: Any = list(range(CHUNK))
    server.fail = ConnectionError("the server went away")
    with pytest.raises(ConnectionError):
        stores.start(tokens, [0, 1], 0, CHUNK, 1, server.commit).result(timeout=10)
    assert stores.stocked == 1 and stores.off is None  # the one used is the server's to free with the session
    server.fail = ServerError("RESERVE", "BAD_ARGUMENT", "this server's pool is not shared")
    with caplog.at_level(logging.WARNING, logger="kvferry.connector"):
        for _ in range(2):
            stores.start(tokens, [0, 1, 2, 3], 0, CHUNK, 1, server.commit)  # two chunks: more than the stock
            stores.refill(1, server.reserve)
            settled(stores)
    assert stores.off is not None and caplog.text.count("stores go through STORE, not direct") == 1
    assert stores.start(tokens, [0, 1], 0, CHUNK, 1, server.commit) is None
    stores.close()


def test_a_refused_commit_turns_direct_stores_off(kv: EngineKV, caplog: pytest.LogCaptureFixture) -> None:
    """A COMMIT the server refuses would be refused again, each leaving its objects reserved: no more direct stores."""
    server, stores = stocked_for_one_chunk(kv)
    tokens: Any = list(range(CHUNK))
    server.fail = ServerError("COMMIT", "BAD_ARGUMENT", "'objects': [0] are not objects reserved for the session")
    with caplog.at_level(logging.WARNING, logger="kvferry.connector"), pytest.raises(ServerError):
        stores.start(tokens, [0, 1], 0, CHUNK, 1, server.commit).result(timeout=10)
    assert stores.off is not None and "the server refused a COMMIT" in caplog.text
    assert stores.start(tokens, [0, 1], 0, CHUNK, 1, server.commit) is None
    stores.close()

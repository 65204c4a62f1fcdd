"""Server-mode transfers the engine's process copies itself, against a ``kvferry server --shared-pool``, in every vLLM
page layout replayed on CPU tensors (and on a GPU): loads out of the server's pool (``direct_loads``), bit-exact as a
RETRIEVE's, the lease ended, a copy that ends after its lease a failed load; stores into objects the server reserved
(``direct_stores``: the first store goes through STORE and asks for objects, the next is copied here and committed,
then loaded bit-exact by another engine's RETRIEVE), ordered after vLLM's stream. Where a transfer cannot be direct
(a private pool, a tensor-parallel rank's heads) STORE and RETRIEVE instead, said once."""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvferry.bench.vllm_views import BENCH_CASES, case_of, load_fixtures, replay
from kvferry.client import KvferryClient
from kvferry.client.pool_map import MappedPool
from kvferry.connector.copy_ends import copied
from kvferry.connector.direct_loads import DirectLoads, LeaseExpired
from kvferry.connector.direct_stores import DirectStores
from kvferry.connector.engine_kv import EngineKV
from kvferry.connector.server_backend import ServerBackend
from kvferry.connector.server_link import ServerDown
from kvferry.connector.settings import ConnectorSettings
from kvferry.connector.worker_backend import make_worker_backend, not_direct
from tests.integrations.page_view_roundtrip import check_roundtrip, gathered, recognised
from tests.server.serverkit import ServerProcess, wait_for

FIXTURES = [f for f in load_fixtures() if case_of(f) not in BENCH_CASES]
SINGLE = [f for f in FIXTURES if case_of(f).tp[1] == 1]
CHUNKS = sorted({2 * case_of(f).block_size for f in FIXTURES})
# On the CPU one case of each layout (MLA or not, kernel blocks or not): the dtypes move as bytes alike; every case
# runs on a GPU (and through RETRIEVE and STORE in the other tests of every layout)
LAYOUTS = list({(case_of(f).layout, case_of(f).mla, case_of(f).kernel_block): f for f in reversed(SINGLE)}.values())


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[int, ServerProcess]]:
    """A shared-pool server per chunk size the cases use (two scheduler blocks), on a Unix socket."""
    flags = ("--shared-pool", "--l1-size-gb", "0.25")
    procs = {c: ServerProcess(*flags, "--chunk-size", str(c), ipc=True) for c in CHUNKS}
    yield procs
    for proc in procs.values():
        assert proc.stop() == 0, "".join(proc.log)


def settings_for(server: ServerProcess, salt: str, direct: bool = True) -> ConnectorSettings:
    return ConnectorSettings(mode="server", server_url=server.ipc_endpoint, direct_loads=direct, salt=salt)


def located_chunks(server: ServerProcess) -> int:
    with KvferryClient(server.endpoint) as client:
        return int(client.stats()["cache"]["located_chunks"])


@pytest.mark.parametrize("fixture", LAYOUTS, ids=lambda f: case_of(f).name)
def test_a_direct_load_is_bit_exact_in_every_layout(servers: dict[int, ServerProcess], fixture: dict) -> None:
    server = servers[2 * case_of(fixture).block_size]
    before = located_chunks(server)
    check_roundtrip(fixture, "cpu", settings_for(server, salt=case_of(fixture).name))
    assert located_chunks(server) == before + 3  # the two chunks and the tail: copied here, not by the server
    with KvferryClient(server.endpoint) as client:
        assert client.stats()["cache"]["read_leases"] == 0


def test_a_private_pool_or_a_ranks_heads_move_through_store_and_retrieve(caplog: pytest.LogCaptureFixture) -> None:
    fixture = SINGLE[0]
    bs = case_of(fixture).block_size
    private = ServerProcess("--chunk-size", str(2 * bs), "--l1-size-gb", "0.25", ipc=True)
    try:
        with caplog.at_level(logging.WARNING, logger="kvferry.connector"):
            check_roundtrip(fixture, "cpu", settings_for(private, salt="private"))
            backend, _ = backend_of(private, fixture, direct=True)
            try:
                for start in range(3):
                    tokens = list(range(start * 1000, start * 1000 + 2 * bs))
                    assert backend.store_async(tokens, [1, 2], 0).result(timeout=30) == 2 * bs
            finally:
                backend.close()
        assert caplog.text.count("loads go through RETRIEVE, not direct") == 1
        assert caplog.text.count("stores go through STORE, not direct") == 1
        assert caplog.text.count("not shared (cache.shared_pool)") == 2
    finally:
        assert private.stop() == 0
    rank = next(f for f in FIXTURES if case_of(f).tp == (1, 2))
    assert not_direct(recognised(case_of(rank), replay(rank, "cpu")[1])) is not None


def test_a_copy_that_ends_after_its_lease_is_a_failed_load(servers: dict[int, ServerProcess]) -> None:
    fixture = SINGLE[0]
    case = case_of(fixture)
    server = servers[2 * case.block_size]
    kv = recognised(case, replay(fixture, "cpu")[1])
    settings = settings_for(server, salt="late")
    backend = make_worker_backend(settings, kv, model=case.name, block_size=case.block_size, name="test")
    assert isinstance(backend, ServerBackend)
    try:
        tokens = list(range(7, 7 + 2 * case.block_size))
        assert backend.store_async(tokens, [3, 5], 0).result(timeout=30) == len(tokens)
        located = backend.link.wait(
            lambda client, reg: client.locate_async(tokens, registration=reg), backend.link.timeout_s
        )
        late = dataclasses.replace(located, deadline=time.monotonic() - 1)
        released: list[bool] = []
        direct = DirectLoads(kv, MappedPool(pin=False))
        with pytest.raises(LeaseExpired):
            direct.start(late, [8, 9], 0, 2 * case.block_size, lambda: released.append(True)).result(timeout=30)
        direct.close()  # its thread ends the lease, then stops
        assert released == [True]
        backend.free_leases(backend.link.generation, [located.lease])
    finally:
        backend.close()


def backend_of(
    server: ServerProcess, fixture: dict[str, Any], direct: bool, device: str = "cpu"
) -> tuple[ServerBackend, EngineKV]:
    case = case_of(fixture)
    kv = recognised(case, replay(fixture, device)[1])
    salt = f"stores-{case.name}"  # apart from the loads' tests of the case
    settings = ConnectorSettings(mode="server", server_url=server.ipc_endpoint, direct_stores=direct, salt=salt)
    backend = make_worker_backend(settings, kv, model=case.name, block_size=case.block_size, name="test")
    assert isinstance(backend, ServerBackend)
    return backend, kv


def adopted_stores(server: ServerProcess) -> int:
    with KvferryClient(server.endpoint) as client:
        return int(client.stats()["cache"]["adopted_stores"])


def warmed_up(writer: ServerBackend, tokens: list[int], block_ids: list[int], objects: int) -> DirectStores:
    """``writer``'s direct stores, once a store through STORE (nothing was reserved yet) has them reserve
    ``objects`` (twice the store's)."""
    stores = writer.direct_stores
    assert stores is not None
    assert writer.store_async(tokens, block_ids, 0).result(timeout=30) > 0
    wait_for(lambda: stores.stocked == objects, f"{objects} objects reserved", 10)
    return stores


@pytest.mark.parametrize(
    ("fixture", "device"),
    [pytest.param(f, "cpu", id=f"{case_of(f).name}-cpu") for f in LAYOUTS]
    + [pytest.param(f, "cuda", marks=pytest.mark.gpu, id=f"{case_of(f).name}-cuda") for f in SINGLE],
)
def test_a_direct_store_loads_bit_exact_in_every_layout(
    servers: dict[int, ServerProcess], fixture: dict, device: str
) -> None:
    case = case_of(fixture)
    bs = case.block_size
    server = servers[2 * bs]
    rng = random.Random(f"stores-{case.name}")
    first, tokens = ([rng.randrange(50_000) for _ in range(5 * bs + 5)] for _ in range(2))
    src, dst = rng.sample(range(case.num_blocks), 6), rng.sample(range(case.num_blocks), 6)
    (writer, kv_a), (reader, kv_b) = (
        backend_of(server, fixture, True, device),
        backend_of(server, fixture, False, device),
    )
    try:
        before = adopted_stores(server)
        stores = warmed_up(writer, first, src, 6)  # two chunks' and a tail's objects, twice
        store = writer.store_async(tokens, src, 2 * bs)  # the first chunk skipped (as stored by an earlier step)
        assert copied(store) == 3 * bs  # the second chunk and the tail, once the copy has ended
        assert store.result(timeout=30) == 3 * bs and adopted_stores(server) == before + 1
        assert stores.stocked == 6  # as many again reserved by the COMMIT
        assert writer.store_async(tokens[: 2 * bs], src, 0).result(timeout=30) == 2 * bs  # the first chunk
        assert reader.retrieve(tokens, dst[:5], 0) == 5 * bs
        for got, want in zip(gathered(kv_b, dst[:5]), gathered(kv_a, src[:5]), strict=True):
            assert torch.equal(got, want)
    finally:
        writer.close()
        reader.close()


@pytest.mark.gpu
def test_a_direct_store_reads_the_blocks_only_after_the_forward_pass_on_vllms_stream(
    servers: dict[int, ServerProcess],
) -> None:
    """vLLM writes the blocks on its stream and asks for the store at once: the copy, enqueued on this process's
    GPU, must wait for that write on the GPU (never the CPU)."""
    fixture = next(f for f in SINGLE if case_of(f).layout == "LBHNC" and case_of(f).backend == "FLASH_ATTN")
    bs = case_of(fixture).block_size
    server = servers[2 * bs]
    (writer, kv_a), (reader, kv_b) = (
        backend_of(server, fixture, True, "cuda"),
        backend_of(server, fixture, False, "cuda"),
    )
    src, dst = [2, 6, 3, 9], [7, 0, 11, 4]
    tokens = [random.Random("ordered").randrange(50_000) for _ in range(4 * bs)]
    vllm_stream = torch.cuda.Stream()
    try:
        before = adopted_stores(server)
        warmed_up(writer, [t + 1 for t in tokens], [1, 5, 8, 10], 4)
        with torch.cuda.stream(vllm_stream):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the "forward pass" writes
            index = torch.as_tensor(src, device="cuda")
            for layer in kv_a.layers:
                layer.index_copy_(0, index, torch.randint_like(layer[src], 0, 100))
            called = time.perf_counter()
            store = writer.store_async(tokens, src, 0)
            returned = time.perf_counter() - called
            expected = gathered(kv_a, src)  # after the write, on its stream
        assert returned < 0.05, f"the store's call took {returned:.3f} s: it waited for vLLM's stream on the CPU"
        assert store.result(timeout=30) == 4 * bs and adopted_stores(server) == before + 1
        assert reader.retrieve(tokens, dst, 0) == 4 * bs
        torch.cuda.synchronize()
        for got, want in zip(gathered(kv_b, dst), expected, strict=True):
            assert torch.equal(got, want)
    finally:
        writer.close()
        reader.close()


def test_direct_stores_start_with_the_server_down(tmp_path: Any) -> None:
    """No server at start (the link retries in the background): the worker starts, and a store fails as any store
    to a server that is down does, not with an error of the direct stores'."""
    fixture = SINGLE[0]
    case = case_of(fixture)
    kv = recognised(case, replay(fixture, "cpu")[1])
    url = f"ipc://{tmp_path}/nobody.sock"
    settings = ConnectorSettings(mode="server", server_url=url, direct_stores=True, direct_loads=True, timeout_s=0.5)
    backend = make_worker_backend(settings, kv, model=case.name, block_size=case.block_size, name="test")
    assert isinstance(backend, ServerBackend) and backend.direct_stores is not None
    try:
        stored = backend.store_async(list(range(2 * case.block_size)), [1, 2], 0)
        assert isinstance(stored.exception(timeout=10), ServerDown)
    finally:
        backend.close()

"""Server-mode loads copied in the engine's process out of the server's shared pool (``direct_loads`` against a
``kvferry server --shared-pool``), in every vLLM page layout replayed on CPU tensors: bit-exact as a RETRIEVE's,
the lease ended, and where a load cannot be direct (a private pool, a tensor-parallel rank's heads) RETRIEVE
instead, said once; a copy that ends after its lease is a failed load."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator

import pytest

from kvferry.bench.vllm_views import BENCH_CASES, case_of, load_fixtures, replay
from kvferry.client import KvferryClient
from kvferry.connector.direct_loads import DirectLoads, LeaseExpired
from kvferry.connector.server_backend import ServerBackend
from kvferry.connector.settings import ConnectorSettings
from kvferry.connector.worker_backend import make_worker_backend
from tests.integrations.page_view_roundtrip import check_roundtrip, recognised
from tests.server.serverkit import ServerProcess

FIXTURES = [f for f in load_fixtures() if case_of(f) not in BENCH_CASES]
SINGLE = [f for f in FIXTURES if case_of(f).tp[1] == 1]
CHUNKS = sorted({2 * case_of(f).block_size for f in FIXTURES})


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


@pytest.mark.parametrize("fixture", SINGLE, ids=lambda f: case_of(f).name)
def test_a_direct_load_is_bit_exact_in_every_layout(servers: dict[int, ServerProcess], fixture: dict) -> None:
    server = servers[2 * case_of(fixture).block_size]
    before = located_chunks(server)
    check_roundtrip(fixture, "cpu", settings_for(server, salt=case_of(fixture).name))
    assert located_chunks(server) == before + 3  # the two chunks and the tail: copied here, not by the server
    with KvferryClient(server.endpoint) as client:
        assert client.stats()["cache"]["read_leases"] == 0


def test_a_private_pool_or_a_ranks_heads_load_through_retrieve(caplog: pytest.LogCaptureFixture) -> None:
    fixture = SINGLE[0]
    private = ServerProcess("--chunk-size", str(2 * case_of(fixture).block_size), "--l1-size-gb", "0.25", ipc=True)
    try:
        with caplog.at_level(logging.WARNING, logger="kvferry.connector"):
            check_roundtrip(fixture, "cpu", settings_for(private, salt="private"))
        assert caplog.text.count("loads go through RETRIEVE, not direct") == 1
        assert "not shared (cache.shared_pool)" in caplog.text
    finally:
        assert private.stop() == 0
    rank = next(f for f in FIXTURES if case_of(f).tp == (1, 2))
    kv = recognised(case_of(rank), replay(rank, "cpu")[1])
    assert DirectLoads.unsupported(kv) is not None


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
        direct = DirectLoads(kv)
        with pytest.raises(LeaseExpired):
            direct.start(late, [8, 9], 0, 2 * case.block_size, lambda: released.append(True)).result(timeout=30)
        direct.close()  # its thread ends the lease, then stops
        assert released == [True]
        backend.free_leases(backend.link.generation, [located.lease])
    finally:
        backend.close()

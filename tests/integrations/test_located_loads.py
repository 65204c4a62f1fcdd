"""Direct loads of hits the scheduler half located (a LOOKUP with ``locate``), against a real ``kvferry server
--shared-pool``: the worker copies the located objects with no LOCATE of its own, bit-exact, in the foreground and in
the background; the scheduler's lock is the objects' read lease, held until the scheduler frees it once the load
ran. The scheduler looks up through the worker's own backend (one process) or through a session of its own (vLLM's
scheduler process). A hit located in a server since gone loads through RETRIEVE, and direct loads stay on."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvferry.bench.vllm_views import case_of, replay
from kvferry.client import KvferryClient
from kvferry.connector.layer_parts import key_space_fields, lookups_from_fields
from kvferry.connector.plan import LoadSpec, StepPlan
from kvferry.connector.server_backend import ServerBackend
from kvferry.connector.server_link import ServerLink
from kvferry.connector.settings import ConnectorSettings
from kvferry.connector.worker_backend import make_worker_backend
from kvferry.connector.worker_side import WorkerSide
from tests.integrations.page_view_roundtrip import gathered, recognised
from tests.integrations.test_direct_transfers import LAYOUTS
from tests.server.serverkit import ServerProcess

FIXTURE = LAYOUTS[0]
CASE = case_of(FIXTURE)
BS = CASE.block_size


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--shared-pool", "--chunk-size", str(2 * BS), "--l1-size-gb", "0.25", ipc=True)
    yield proc
    assert proc.stop() == 0, "".join(proc.log)


def cache_stats(server: ServerProcess) -> dict[str, int]:
    with KvferryClient(server.endpoint) as client:
        return client.stats()["cache"]


class Engine:
    """One engine's replayed KV and its worker half's server backend (direct loads on)."""

    def __init__(self, server: ServerProcess, salt: str) -> None:
        self.kv = recognised(CASE, replay(FIXTURE, "cpu")[1])
        settings = ConnectorSettings(mode="server", server_url=server.ipc_endpoint, direct_loads=True, salt=salt)
        backend = make_worker_backend(settings, self.kv, model=CASE.name, block_size=BS, name="test")
        assert isinstance(backend, ServerBackend)
        self.backend = backend
        self.worker = WorkerSide(backend, block_size=BS)

    def close(self) -> None:
        self.worker.close()
        self.backend.close()


def stored(server: ServerProcess, salt: str, seed: int) -> tuple[list[int], list[torch.Tensor]]:
    """Two chunks and a one-block tail of one engine's random blocks stored: their tokens and bytes."""
    rng = random.Random(seed)
    tokens = [rng.randrange(50_000) for _ in range(5 * BS)]
    src = rng.sample(range(1, CASE.num_blocks), 5)
    writer = Engine(server, salt)
    try:
        assert writer.backend.store_async(tokens, src, 0).result(timeout=30) == len(tokens)
        return tokens, gathered(writer.kv, src)
    finally:
        writer.close()


@pytest.fixture
def no_locate(monkeypatch: pytest.MonkeyPatch) -> None:
    """A LOCATE on the load's path fails the load (and so the test)."""

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a load sent LOCATE for a hit the scheduler had located")

    monkeypatch.setattr(KvferryClient, "locate", refused)


@pytest.mark.parametrize("in_background", [False, True], ids=["foreground", "background"])
@pytest.mark.parametrize("scheduler", ["worker's backend", "own session"])
def test_a_located_hit_is_copied_with_no_locate_under_the_schedulers_lease(
    server: ServerProcess, scheduler: str, in_background: bool, request: pytest.FixtureRequest
) -> None:
    salt = f"{scheduler}-{in_background}"
    tokens, expected = stored(server, salt, seed=len(salt))
    engine = Engine(server, salt)
    lookups: Any = engine.backend
    if scheduler == "own session":
        lookups = lookups_from_fields(
            ServerLink(server.endpoint, timeout_s=30), key_space_fields(engine.backend), BS, locate=True
        )
        lookups.link.connect()
    try:
        hit = lookups.lookup(tokens)
        assert hit is not None and hit.tokens == len(tokens) and hit.located is not None
        assert hit.located.lease == hit.lock[1]
        dst = random.Random(salt).sample(range(1, CASE.num_blocks), 5)
        retrieves = cache_stats(server)["retrieves"]
        request.getfixturevalue("no_locate")
        engine.worker.start_loads(StepPlan(loads=[LoadSpec("r", tokens, dst, BS, in_background, located=hit.located)]))
        if in_background:
            engine.worker.drain()
            assert engine.worker.finished_loading() == {"r"}
        assert engine.worker.take_load_errors() == set() and engine.worker.counters.tokens_loaded == 4 * BS
        for got, want in zip(gathered(engine.kv, dst[1:]), expected, strict=True):
            assert torch.equal(got, want[engine.kv.split :])  # vLLM's own first block skipped
        stats = cache_stats(server)
        assert stats["retrieves"] == retrieves and stats["read_leases"] == 1  # copied here, under the lease
        lookups.free_lock(hit.lock)  # the scheduler, once the workers reported the load
        assert cache_stats(server)["read_leases"] == 0
    finally:
        if lookups is not engine.backend:
            lookups.close()
        engine.close()


def test_a_hit_located_in_a_server_since_gone_loads_through_retrieve(server: ServerProcess) -> None:
    tokens, expected = stored(server, "gone", seed=7)
    engine = Engine(server, "gone")
    try:
        hit = engine.backend.lookup(tokens)
        assert hit is not None and hit.located is not None
        gone = dataclasses.replace(hit.located, pool=(2**30, 3, hit.located.pool[2]))  # no such process
        retrieves = cache_stats(server)["retrieves"]
        for located in (gone, hit.located):
            dst = random.Random(str(located)).sample(range(1, CASE.num_blocks), 5)
            engine.worker.start_loads(StepPlan(loads=[LoadSpec("r", tokens, dst, 0, located=located)]))
            assert engine.worker.take_load_errors() == set()
            for got, want in zip(gathered(engine.kv, dst), expected, strict=True):
                assert torch.equal(got, want)
        assert cache_stats(server)["retrieves"] == retrieves + 1  # the stale one; the next copied here
        engine.backend.free_lock(hit.lock)
    finally:
        engine.close()

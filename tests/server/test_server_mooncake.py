"""Two `kvferry server` processes (two pools, standing in for two nodes) sharing prefixes through one Mooncake
store: what one stores, the other loads from Mooncake into its pool and serves, bit-exact, without the first."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvferry.client import KvferryClient
from tests.server.serverkit import FMT_REAL, PER_CHUNK, REAL_CHUNK, REAL_NS, ServerProcess, blocks, real_kv, wait_for
from tests.tiers.mooncakekit import MooncakeStore, need_mooncake


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeStore]:
    need_mooncake()
    running = MooncakeStore(tmp_path_factory.mktemp("mooncake")).start()
    yield running
    running.kill()


def _node(store: MooncakeStore, config: Path, name: str) -> ServerProcess:
    return ServerProcess(
        "--config", str(config), "--chunk-size", str(REAL_CHUNK), "--l1-size-gb", "0.05",
        "--tier-check-interval", "0.2", "--l2", store.url(segment="32MiB", buffer="16MiB", name=name),
    )  # fmt: skip


def test_a_prefix_stored_on_one_node_is_served_by_the_other_from_mooncake(store: MooncakeStore, tmp_path: Path) -> None:
    config = tmp_path / "kvferry.yaml"
    config.write_text("cache:\n  tier_write: on_store\n")  # what a shared tier needs: written when stored
    with ThreadPoolExecutor(2) as starting:  # each start imports torch: on two cores, at once
        first, second = starting.map(lambda name: _node(store, config, name), ["mooncake-a", "mooncake-b"])
    try:
        tokens = list(range(1000, 1000 + 3 * REAL_CHUNK))
        ids = list(range(3 * PER_CHUNK))
        stored_kv = real_kv(seed=1)
        with KvferryClient(first.endpoint) as writer:
            reg = writer.register_kv_cache(stored_kv, FMT_REAL, namespace=REAL_NS)
            assert writer.store(reg, tokens, ids) == len(tokens)
        wait_for(lambda: _tier_ops(first).get("put", {}).get("stored") == 3, "the first node's writes to Mooncake")
        loaded_kv = real_kv(seed=2)  # other bits: a copy that did not happen would show
        with KvferryClient(second.endpoint) as reader:
            reg = reader.register_kv_cache(loaded_kv, FMT_REAL, namespace=REAL_NS)
            found = reader.lookup(tokens + list(range(5000, 5000 + REAL_CHUNK)), registration=reg)
            assert found.tokens + found.pending == len(tokens)  # on its way from Mooncake into this pool
            wait_for(lambda: reader.lookup(tokens, registration=reg).tokens == len(tokens), "the load into the pool")
            target = list(range(10, 10 + len(ids)))
            assert reader.retrieve(reg, tokens, target) == len(tokens)
            assert blocks(loaded_kv, target).equal(blocks(stored_kv, ids))
        assert _tier_ops(second)["get"] == {"hit": 3}
        assert _get(second, "/health")["status"] == "ok"
    finally:
        with ThreadPoolExecutor(2) as stopping:  # each closes its Mooncake client (~2 s)
            assert list(stopping.map(ServerProcess.stop, [first, second])) == [0, 0]


def _tier_ops(server: ServerProcess) -> dict:
    return _get(server, "/stats")["cache"]["tiers"][0]["ops"]


def _get(server: ServerProcess, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}{path}", timeout=10) as response:
        return json.loads(response.read())

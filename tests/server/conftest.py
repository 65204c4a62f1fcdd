"""Fixtures: an in-process server over the fake engine, and clients of it."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest

from kvferry.client import KvferryClient
from kvferry.config import ServerConfig
from kvferry.server import KvferryServer
from tests.server.serverkit import FakeEngine


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(chunk_size=4)


@pytest.fixture
def server_config() -> Iterator[ServerConfig]:
    with tempfile.TemporaryDirectory(prefix="kvf-") as sockets:  # short: a Unix socket path has ~100 bytes at most
        yield ServerConfig(
            port=0,
            http_port=0,
            ipc_path=os.path.join(sockets, "server.sock"),
            heartbeat_interval_s=0.1,
            heartbeat_timeout_s=1.0,
            max_message_bytes=64 * 1024,
        )


@pytest.fixture
def server(engine: FakeEngine, server_config: ServerConfig) -> Iterator[KvferryServer]:
    srv = KvferryServer(server_config, engine)  # type: ignore[arg-type]
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def endpoint(request: pytest.FixtureRequest, server: KvferryServer) -> str:
    """The server's TCP endpoint; its Unix socket (kvferry.server.unix_clients) where a test parametrizes this
    fixture indirectly with "ipc"."""
    return endpoint_of(server, getattr(request, "param", "tcp"))


def endpoint_of(server: KvferryServer, kind: str) -> str:
    """``server``'s TCP (ZMQ) endpoint, or with ``kind`` "ipc" its Unix socket (kvferry.server.unix_clients)."""
    return str(server.ipc_endpoint) if kind == "ipc" else f"tcp://127.0.0.1:{server.port}"


TCP_AND_IPC = pytest.mark.parametrize("endpoint", ["tcp", "ipc"], indirect=True)


@pytest.fixture
def client(endpoint: str) -> Iterator[KvferryClient]:
    with KvferryClient(endpoint, timeout_s=10) as c:
        yield c

"""The server's Unix socket (`kvferry.server.unix_clients`, `kvferry.client.unix_link`): what differs from ZMQ.

The requests themselves run over both transports in test_server.py; here: connecting before the server exists, a
server restart, frames a client library would never send, a client that stops reading, a frame cut short (the
framing itself: tests/protocol/test_unix_framing.py).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Iterator

import msgpack
import pytest

from kvferry.client import KvferryClient, RegistrationLost, ServerUnavailable
from kvferry.config import ServerConfig
from kvferry.protocol.messages import Op, encode_request
from kvferry.protocol.unix_framing import HEADER, frame
from kvferry.server import KvferryServer, unix_clients
from tests.server.serverkit import FakeEngine, random_kv, read_frame, wait_for

FMT = 3
NS = {"model": "fake-model"}


@pytest.fixture
def path() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="kvf-") as sockets:
        yield os.path.join(sockets, "server.sock")


def _server(path: str, engine: FakeEngine, **config: float) -> KvferryServer:
    server = KvferryServer(
        ServerConfig(port=0, http_port=None, ipc_path=path, max_message_bytes=64 * 1024, **config),  # type: ignore[arg-type]
        engine,
    )
    server.start()
    return server


def _raw(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    return sock


def test_tcp_and_unix_clients_share_one_cache(path: str) -> None:
    engine = FakeEngine()
    server = _server(path, engine)
    try:
        tokens = list(range(8))
        with KvferryClient(f"ipc://{path}") as near, KvferryClient(f"tcp://127.0.0.1:{server.port}") as far:
            reg = near.register_kv_cache(random_kv(1), FMT, namespace=NS)
            assert near.store(reg, tokens, [0, 1, 2, 3]) == 8
            other = far.register_kv_cache(random_kv(2), FMT, namespace=NS)
            assert far.lookup(tokens, registration=other).tokens == 8
            assert len(server.stats()["sessions"]) == 2
    finally:
        server.stop()


def test_a_client_started_before_its_server_fails_fast_then_connects(path: str) -> None:
    with KvferryClient(f"ipc://{path}", timeout_s=5) as client:
        started = time.monotonic()
        with pytest.raises(ServerUnavailable):
            client.ping()
        assert time.monotonic() - started < 1
        server = _server(path, FakeEngine())
        try:
            assert client.wait_available(10)
            assert client.ping()["chunk_size"] == 4
        finally:
            server.stop()


def test_a_restarted_server_is_reached_again_and_old_registrations_are_lost(path: str) -> None:
    server = _server(path, FakeEngine())
    with KvferryClient(f"ipc://{path}", timeout_s=5) as client:
        reg = client.register_kv_cache(random_kv(3), FMT, namespace=NS)
        assert client.store(reg, list(range(8)), [0, 1, 2, 3]) == 8
        server.stop()
        wait_for(lambda: not client.available, "the client to see the server gone")
        with pytest.raises(ServerUnavailable):
            client.lookup(list(range(8)), registration=reg)
        server = _server(path, FakeEngine())
        try:
            assert client.wait_available(10)
            with pytest.raises(RegistrationLost):
                client.store(reg, list(range(8)), [0, 1, 2, 3])
            again = client.register_kv_cache(random_kv(3), FMT, namespace=NS)
            assert client.store(again, list(range(8)), [0, 1, 2, 3]) == 8
        finally:
            server.stop()


def test_bad_frames_cost_only_their_own_connection(path: str) -> None:
    server = _server(path, FakeEngine())
    try:
        with KvferryClient(f"ipc://{path}") as bystander, _raw(path) as raw:
            bystander.ping()
            raw.sendall(frame(b"\xc1 not msgpack"))
            reply = msgpack.unpackb(read_frame(raw))
            assert (reply["ok"], reply["error"]["code"]) == (False, "MALFORMED")
            raw.sendall(HEADER.pack(64 * 1024 + 1) + b"x" * 100)  # longer than the server takes
            assert raw.recv(1) == b""  # dropped
            wait_for(lambda: len(server.stats()["sessions"]) == 1, "the dropped client's session to end")
            assert bystander.ping()["chunk_size"] == 4
    finally:
        server.stop()


def test_a_frame_cut_short_is_never_run(path: str) -> None:
    engine = FakeEngine()
    server = _server(path, engine)
    try:
        with KvferryClient(f"ipc://{path}") as client:
            reg = client.register_kv_cache(random_kv(4), FMT, namespace=NS)
            assert client.store(reg, list(range(8)), [0, 1, 2, 3]) == 8
            with _raw(path) as raw:
                raw.sendall(frame(encode_request(Op.CLEAR, 1, {}))[:-1])
                wait_for(lambda: len(server._unix._by_fd) == 2, "the cut connection to be read")  # type: ignore[union-attr]
            wait_for(lambda: len(server._unix._by_fd) == 1, "the cut connection to be dropped")  # type: ignore[union-attr]
            assert engine.objects  # CLEAR never ran
            assert client.lookup(list(range(8)), registration=reg).tokens == 8
    finally:
        server.stop()


def test_a_client_that_stops_reading_is_dropped_without_stalling_others(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(unix_clients, "_UNSENT_LIMIT", 256 * 1024)
    server = _server(path, FakeEngine())
    try:
        with KvferryClient(f"ipc://{path}") as bystander, _raw(path) as greedy:
            greedy.settimeout(0.5)
            stats = frame(encode_request(Op.STATS, 1, {}))
            with pytest.raises(OSError):  # reset or broken pipe once the server drops it (or a send timing out)
                for _ in range(100_000):  # its replies are never read
                    greedy.sendall(stats)
            wait_for(lambda: server.metrics.sessions_ended.labels("disconnect")._value.get() == 1, "the drop")
            started = time.monotonic()
            assert bystander.ping()["chunk_size"] == 4
            assert time.monotonic() - started < 1
    finally:
        server.stop()

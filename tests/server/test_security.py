"""Authentication on the server's listeners (`kvferry.server.auth`): CURVE on the request socket, the HTTP token,
the Unix socket's mode and group. Tenants kept apart: test_tenants.py."""

from __future__ import annotations

import os
import stat
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvferry.client import KvferryClient, ServerUnavailable
from kvferry.config import ServerConfig
from kvferry.protocol.messages import Op, encode_request
from kvferry.security import ClientCurve, SecurityConfig
from kvferry.server import KvferryServer
from tests.server.serverkit import FakeEngine

Keys = tuple[bytes, bytes]


@pytest.fixture
def server_keys() -> Keys:
    return zmq.curve_keypair()


@pytest.fixture
def client_keys() -> Keys:
    return zmq.curve_keypair()


@pytest.fixture
def curve_server(tmp_path: Path, server_keys: Keys, client_keys: Keys) -> Iterator[KvferryServer]:
    (tmp_path / "clients").write_text(client_keys[0].decode() + "\n")
    security = SecurityConfig(
        curve_secret_key=server_keys[1].decode(), curve_client_keys=str(tmp_path / "clients"), http_token="s3cr3t"
    )
    server = KvferryServer(ServerConfig(port=0, http_port=0), FakeEngine(), security=security)  # type: ignore[arg-type]
    server.start()
    yield server
    server.stop()


def _endpoint(server: KvferryServer) -> str:
    return f"tcp://127.0.0.1:{server.port}"


def test_a_client_with_an_allowed_key_is_served(
    curve_server: KvferryServer, server_keys: Keys, client_keys: Keys
) -> None:
    curve = ClientCurve(server_public=server_keys[0], public=client_keys[0], secret=client_keys[1])
    with KvferryClient(_endpoint(curve_server), timeout_s=5, curve=curve) as client:
        assert client.ping()["chunk_size"] == 4
        assert client.lookup(list(range(8)), namespace=_NAMESPACE).tokens == 0
        assert len(client.stats()["server"]["sessions"]) == 1


_NAMESPACE = {"model": "m", "kv_dtype": "float32", "layout": "fake:3"}


@pytest.mark.parametrize("who", ["stranger", "wrong-key", "wrong-server-key"])
def test_a_client_without_an_allowed_key_is_refused_and_learns_nothing(
    curve_server: KvferryServer, server_keys: Keys, client_keys: Keys, who: str
) -> None:
    other = zmq.curve_keypair()
    curve = {
        "stranger": None,
        "wrong-key": ClientCurve(server_public=server_keys[0], public=other[0], secret=other[1]),
        "wrong-server-key": ClientCurve(server_public=other[0], public=client_keys[0], secret=client_keys[1]),
    }[who]
    with KvferryClient(_endpoint(curve_server), timeout_s=2, curve=curve) as client:
        with pytest.raises(ServerUnavailable):
            client.stats()
        with pytest.raises(ServerUnavailable):
            client.lookup(list(range(8)), namespace=_NAMESPACE)
    assert curve_server.stats()["sessions"] == []


def test_a_raw_zmq_socket_without_keys_gets_no_answer(curve_server: KvferryServer) -> None:
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as dealer:
        dealer.linger = 0
        dealer.connect(_endpoint(curve_server))
        dealer.send(encode_request(Op.STATS, 1, {}, None))
        assert dealer.poll(500) == 0
    assert curve_server.stats()["sessions"] == []


def test_a_refused_key_is_logged_once_however_often_it_comes_back(
    curve_server: KvferryServer, server_keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    public, secret = zmq.curve_keypair()
    with zmq.Context() as ctx:
        for _ in range(3):  # three connections, each refused at its handshake
            with ctx.socket(zmq.DEALER) as dealer:
                dealer.linger = 0
                dealer.curve_serverkey, dealer.curve_publickey, dealer.curve_secretkey = server_keys[0], public, secret
                monitor = dealer.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
                dealer.connect(_endpoint(curve_server))
                assert monitor.poll(5000)
                dealer.disable_monitor()
                monitor.close()
    refusals = [r for r in caplog.records if "unknown CURVE key" in r.getMessage()]
    assert len(refusals) == 1 and public.decode() in refusals[0].getMessage()


def _get(server: KvferryServer, path: str, token: str | None) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}{path}")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read()


def test_http_views_ask_for_the_token(curve_server: KvferryServer) -> None:
    for path in ("/stats", "/metrics", "/nowhere"):
        assert _get(curve_server, path, None) == (401, b"")
        assert _get(curve_server, path, "guess")[0] == 401
    assert _get(curve_server, "/stats", "s3cr3t")[0] == 200
    assert b"kvferry" in _get(curve_server, "/metrics", "s3cr3t")[1]
    assert _get(curve_server, "/health", None) == (200, b'{"status": "ok"}')  # a probe's answer: no counts
    assert b'"sessions"' in _get(curve_server, "/health", "s3cr3t")[1]


@pytest.mark.parametrize(("mode", "group"), [("0600", False), ("0660", True)])
def test_the_unix_socket_gets_the_configured_mode_and_group(mode: str, group: bool) -> None:
    # root may give the file any group: one it is not in shows the chown took; others may give only their own
    gid = (4242 if os.geteuid() == 0 else os.getegid()) if group else os.getegid()
    security = SecurityConfig(ipc_mode=mode, ipc_group=str(gid) if group else None)
    with tempfile.TemporaryDirectory(prefix="kvf-") as folder:
        path = os.path.join(folder, "s.sock")
        config = ServerConfig(port=0, http_port=None, ipc_path=path)
        server = KvferryServer(config, FakeEngine(), security=security)  # type: ignore[arg-type]
        server.start()
        try:
            info = os.stat(path)
            assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == int(mode, 8)
            assert info.st_gid == gid
            with KvferryClient(f"ipc://{path}", timeout_s=5) as client:
                assert client.ping()["chunk_size"] == 4
        finally:
            server.stop()

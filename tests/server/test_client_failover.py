"""The client never stalls an engine on a dead, absent or frozen server, and recovers by itself."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections.abc import Iterator

import pytest

from kvferry.client import KvferryClient, RegistrationLost, ServerError, ServerUnavailable
from kvferry.client.link import UP
from kvferry.config import ServerConfig
from kvferry.server import KvferryServer
from tests.ports import port_for_a_restart
from tests.server.serverkit import (
    FMT_REAL,
    REAL_CHUNK,
    REAL_NS,
    FakeEngine,
    ServerProcess,
    freeze,
    random_kv,
    real_kv,
    wait_for,
)

FMT = 3
NS = {"model": "fake-model"}
KEY_SPACE = {"model": "m", "kv_dtype": "bfloat16", "layout": "fake:3"}


class Restartable:
    """In-process servers over fresh fake engines, one after another on one port (a server restart)."""

    def __init__(self) -> None:
        self.port = port_for_a_restart()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.server: KvferryServer | None = None
        self.engine = FakeEngine()

    def start(self) -> FakeEngine:
        self.engine = FakeEngine()
        config = ServerConfig(
            port=self.port, http_port=None, heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0, transfer_workers=1
        )
        self.server = KvferryServer(config, self.engine)
        self.server.start()
        return self.engine

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


@pytest.fixture
def restartable() -> Iterator[Restartable]:
    servers = Restartable()
    yield servers
    servers.stop()


def _fails_fast(call: object, limit_s: float = 0.5) -> ServerUnavailable:
    started = time.monotonic()
    with pytest.raises(ServerUnavailable) as failed:
        call()  # type: ignore[operator]
    assert time.monotonic() - started < limit_s
    return failed.value


def test_a_client_made_before_its_server_fails_fast_then_recovers(restartable: Restartable) -> None:
    started = time.monotonic()
    client = KvferryClient(restartable.endpoint, timeout_s=10)
    try:
        assert time.monotonic() - started < 0.5 and not client.available
        error = _fails_fast(client.ping)
        assert restartable.endpoint in str(error) and isinstance(error, ConnectionError)
        _fails_fast(lambda: client.chunk_size)
        restartable.start()
        assert client.wait_available(10)
        assert client.chunk_size == 4 and client.ping()["version"] == 1
    finally:
        client.close()


def test_requests_made_while_the_server_is_down_fail_at_once_and_are_never_delivered(
    restartable: Restartable,
) -> None:
    restartable.start()
    with KvferryClient(restartable.endpoint, timeout_s=10) as client:
        assert client.ping()["version"] == 1
        restartable.stop()
        wait_for(lambda: not client.available, "the client to see the server gone")
        for _ in range(20):
            _fails_fast(lambda: client.lookup(list(range(8)), namespace=KEY_SPACE))
            with pytest.raises(ServerUnavailable):
                client.lookup_async(list(range(8)), namespace=KEY_SPACE)
        engine = restartable.start()
        assert client.wait_available(10)
        time.sleep(0.3)
        assert engine.fake_calls._value.get() == 0  # nothing queued while it was down reached the new server
        assert client.lookup(list(range(8)), namespace=KEY_SPACE).tokens == 0
        assert engine.fake_calls._value.get() == 1


def test_after_a_server_restart_a_registration_is_reported_lost(restartable: Restartable) -> None:
    restartable.start()
    with KvferryClient(restartable.endpoint, timeout_s=10) as client:
        kv = random_kv(1)
        reg = client.register_kv_cache(kv, FMT, namespace=NS)
        assert client.store(reg, list(range(8)), [0, 1, 2, 3]) == 8
        restartable.stop()
        # Seen gone first: a store sent before the client notices the old connection's end fails with that instead
        wait_for(lambda: not client.available, "the client to see the server gone")
        restartable.start()
        assert client.wait_available(10)
        with pytest.raises(RegistrationLost) as lost:
            client.store(reg, list(range(8)), [0, 1, 2, 3])
        assert lost.value.code == "UNKNOWN_REGISTRATION" and isinstance(lost.value, ServerError)
        again = client.register_kv_cache(kv, FMT, namespace=NS)
        assert again != reg and client.store(again, list(range(8)), [0, 1, 2, 3]) == 8


def test_a_client_taken_up_by_a_reply_read_after_its_server_went_is_down_by_its_next_heartbeat(
    restartable: Restartable,
) -> None:
    """A reply read after the connection dropped (the server's last answers, sent as it stopped) marks the client up
    again; its next heartbeat, which no connection takes, puts it down (seen in CI: up for good, its server gone)."""
    restartable.start()
    with KvferryClient(restartable.endpoint, timeout_s=10) as client:
        client.register_kv_cache(random_kv(4), FMT, namespace=NS)
        restartable.stop()
        wait_for(lambda: not client.available, "the client to see the server gone")
        client._conn.set_state(UP)  # as a late reply does
        wait_for(lambda: not client.available, "the next heartbeat to find no connection", timeout=5.0)


def test_a_session_the_server_ended_continues_under_a_new_id(restartable: Restartable) -> None:
    restartable.start()
    with KvferryClient(restartable.endpoint, timeout_s=10) as client:
        reg = client.register_kv_cache(random_kv(2), FMT, namespace=NS)
        old = client.session_id
        assert restartable.server is not None
        restartable.server._end_session(old, "heartbeat")  # as if this client had been frozen past its timeout
        with pytest.raises(RegistrationLost):
            client.store(reg, list(range(8)), [0, 1, 2, 3])
        wait_for(lambda: client.session_id != old and client.available, "a new session")
        again = client.register_kv_cache(random_kv(2), FMT, namespace=NS)
        assert client.store(again, list(range(8)), [0, 1, 2, 3]) == 8
        assert [s["session"] for s in restartable.server.stats()["sessions"]] == [client.session_id.hex()]


def test_no_request_waits_past_its_timeout_even_unwatched(restartable: Restartable) -> None:
    engine = restartable.start()
    with KvferryClient(restartable.endpoint, timeout_s=1) as client:
        reg = client.register_kv_cache(random_kv(3), FMT, namespace=NS)
        engine.gate.clear()  # the server holds every store (its heartbeats are answered meanwhile)
        try:
            started = time.monotonic()
            held = client.store_async(reg, list(range(8)), [0, 1, 2, 3])
            with pytest.raises(TimeoutError):
                held.result(timeout=5)
            assert 0.9 < time.monotonic() - started < 3  # its timeout, with room for a loaded machine
            late = client.store_async(reg, list(range(8)), [0, 1, 2, 3])  # queued behind it: starts too late
            time.sleep(1.2)
        finally:
            engine.gate.set()
        with pytest.raises(TimeoutError):
            late.result(timeout=5)
        assert client.ping()["version"] == 1
        wait_for(lambda: engine.stores == 1, "the held store to finish")  # the late one never ran


@pytest.fixture(scope="module")
def server_process() -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--chunk-size", str(REAL_CHUNK), "--l1-size-gb", "0.05", "--heartbeat-interval", "0.2",
        "--heartbeat-timeout", "1", "--transfer-workers", "2",
    )  # fmt: skip
    yield proc
    if proc.proc.poll() is None:
        proc.proc.send_signal(signal.SIGCONT)
        proc.stop()


def test_a_frozen_server_fails_requests_fast_and_never_runs_them_late(server_process: ServerProcess) -> None:
    tokens = list(range(7000, 7000 + REAL_CHUNK))
    kv = real_kv(seed=5)
    with KvferryClient(server_process.endpoint, timeout_s=2) as client, KvferryClient(server_process.endpoint) as peer:
        reg = client.register_kv_cache(kv, FMT_REAL, namespace=REAL_NS)
        assert client.store(reg, tokens, list(range(REAL_CHUNK // 16))) == REAL_CHUNK
        freeze(server_process.pid)
        try:
            started = time.monotonic()
            stale = client.lookup_async(tokens, registration=reg, lock=True)  # reaches the frozen server
            with pytest.raises((ServerUnavailable, TimeoutError)):
                stale.result(timeout=10)
            assert time.monotonic() - started < 2.5
            wait_for(lambda: not client.available, "the client to give the server up")
            _fails_fast(lambda: client.lookup(tokens, registration=reg))
            time.sleep(max(0.0, 2.2 - (time.monotonic() - started)))  # past the stale request's deadline
        finally:
            server_process.proc.send_signal(signal.SIGCONT)
        # Both clients may have given the frozen server up (the idle peer by its heartbeats): each gets it back.
        assert client.wait_available(10) and peer.wait_available(10)
        assert client.lookup(tokens, registration=reg).tokens == REAL_CHUNK
        assert peer.stats()["cache"]["locks"] == 0  # the lookup sent before the freeze was not run after it


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_a_client_stalled_itself_does_not_take_its_server_for_gone(transport: str) -> None:
    """The client's own process stalls (stopped, swapped) with a heartbeat and a request in flight, for longer than
    the silence timeout; their replies come meanwhile. On resuming it reads them: the server is not declared
    unreachable and the request succeeds. (The client's thread is held on its socket lock, as a stopped process
    would hold it, while the replies arrive.)"""
    with tempfile.TemporaryDirectory(prefix="kvf-") as sockets:  # short: a Unix socket path has ~100 bytes at most
        config = ServerConfig(port=0, http_port=None, heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0,
                              ipc_path=os.path.join(sockets, "s.sock"))  # fmt: skip
        server = KvferryServer(config, FakeEngine())
        server.start()
        endpoint = f"tcp://127.0.0.1:{server.port}" if transport == "tcp" else str(server.ipc_endpoint)
        try:
            with KvferryClient(endpoint, timeout_s=10) as client:
                client.ping()
                conn = client._conn
                with conn._socket_lock:
                    pending = client.lookup_async(list(range(8)), namespace=KEY_SPACE)
                    conn._link.probe()  # then a heartbeat (sending it reads nothing: its reply stays unread)
                    time.sleep(2 * conn.silence_timeout_s)  # both replies wait in the socket
                assert pending.result(timeout=5).tokens == 0
                assert client.available
        finally:
            server.stop()

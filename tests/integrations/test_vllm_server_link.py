"""The connector's circuit breaker around the kvferry client, with a scripted client (no server, no vLLM)."""

from __future__ import annotations

import logging
import signal
import time
from concurrent.futures import Future
from typing import Any

import pytest

from kvferry.client import ServerError
from kvferry.connector.server_link import ServerDown, ServerLink
from tests.server.serverkit import ServerProcess, freeze


class FakeServer:
    """What the fake clients talk to: ``up`` decides whether they answer; registrations are counted."""

    def __init__(self, chunk_size: int = 256) -> None:
        self.up = False
        self.chunk_size = chunk_size
        self.registrations = 0
        self.clients: list[FakeClient] = []

    def make_client(self, url: str, timeout_s: float) -> FakeClient:
        if not self.up:
            raise TimeoutError(f"no reply from {url} within {timeout_s} s")
        client = FakeClient(self)
        self.clients.append(client)
        return client


class FakeClient:
    def __init__(self, server: FakeServer) -> None:
        self.server = server
        self.closed = False

    def _check(self) -> None:
        if not self.server.up:
            raise ConnectionError("the server has not answered")

    def get_chunk_size(self) -> int:
        self._check()
        return self.server.chunk_size

    def unregister_kv_cache(self, registration: int) -> None:
        raise ServerError("UNREGISTER_KV_CACHE", "UNKNOWN_REGISTRATION", "restarted")

    def lookup(self) -> int:
        self._check()
        return 7

    def store_async(self) -> Future[int]:
        future: Future[int] = Future()
        if self.server.up:
            future.set_result(1)
        else:
            future.set_exception(ConnectionError("gone"))
        return future

    def close(self, timeout_s: float | None = None) -> None:
        self.closed = True


def register(client: FakeClient) -> int:
    client.server.registrations += 1
    return client.server.registrations


def wait_for(condition: Any, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def make_link(server: FakeServer) -> ServerLink:
    return ServerLink("tcp://127.0.0.1:1", timeout_s=0.1, register=register, make_client=server.make_client)


def test_a_server_absent_at_start_gives_fast_misses_one_warning_and_a_later_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = FakeServer()
    link = make_link(server)
    with caplog.at_level(logging.INFO, logger="kvferry"):
        assert link.connect() is False
        started = time.monotonic()
        for _ in range(100):
            with pytest.raises(ServerDown):
                link.call(lambda client, reg: client.lookup())
            assert link.submit(lambda client, reg: client.store_async()).exception() is not None
        assert time.monotonic() - started < 0.5  # no call waited for anything
        server.up = True
        wait_for(lambda: link.up)
        assert link.call(lambda client, reg: (client.lookup(), reg)) == (7, 1)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "is unavailable" in warnings[0].getMessage()
    assert "connected to the kvferry server" in caplog.text
    assert link.chunk_size == 256 and link.generation == 1
    link.close()
    assert server.clients[0].closed


def test_an_outage_trips_once_and_recovery_registers_again(caplog: pytest.LogCaptureFixture) -> None:
    server = FakeServer()
    server.up = True
    link = make_link(server)
    assert link.connect() is True and server.registrations == 1
    server.up = False  # the server dies
    with caplog.at_level(logging.WARNING, logger="kvferry"):
        with pytest.raises(ConnectionError):
            link.call(lambda client, reg: client.lookup())
        failed = link.submit(lambda client, reg: client.store_async())
        assert isinstance(failed.exception(), ServerDown)  # not even sent
        with pytest.raises(ServerDown):
            link.call(lambda client, reg: client.lookup())
    assert caplog.text.count("is unavailable") == 1
    server.up = True  # restarted: it lost our registration
    wait_for(lambda: link.up)
    assert server.registrations == 2 and link.generation == 2
    assert link.call(lambda client, reg: reg) == 2
    link.close()


def test_unknown_registration_from_a_restarted_server_trips_the_link() -> None:
    server = FakeServer()
    server.up = True
    link = make_link(server)
    link.connect()

    def forgotten(client: FakeClient, reg: int | None) -> None:
        raise ServerError("RETRIEVE", "UNKNOWN_REGISTRATION", "no such registration")

    with pytest.raises(ServerError):
        link.call(forgotten)
    wait_for(lambda: link.up and server.registrations == 2)
    with pytest.raises(ServerError):  # a server refusing one call is not an outage
        link.call(lambda client, reg: (_ for _ in ()).throw(ServerError("STORE", "BAD_ARGUMENT", "x")))
    assert link.up
    link.close()


def test_a_bad_chunk_size_refuses_at_start_and_a_changed_one_stays_off(caplog: pytest.LogCaptureFixture) -> None:
    server = FakeServer(chunk_size=200)
    server.up = True

    def check(chunk_size: int) -> None:
        if chunk_size % 128:
            raise ValueError(f"chunk size {chunk_size} is not a multiple of 128")

    with pytest.raises(ValueError, match="chunk size 200"):
        make_link(server).connect(check_chunk_size=check)
    server.chunk_size = 256
    link = make_link(server)
    assert link.connect(check_chunk_size=check)
    server.up = False
    with pytest.raises(ConnectionError):
        link.call(lambda client, reg: client.lookup())
    server.chunk_size, server.up = 512, True  # restarted with another chunk size: keys would not match
    with caplog.at_level(logging.ERROR, logger="kvferry"):
        wait_for(lambda: link.incompatible is not None)
        wait_for(lambda: "now uses chunk size 512" in caplog.text)
    assert not link.up
    with pytest.raises(ServerDown, match="now uses chunk size 512"):
        link.call(lambda client, reg: client.lookup())
    link.close()


def test_closing_the_link_of_a_frozen_server_takes_a_bounded_time() -> None:
    """An engine's shutdown (its operator's Ctrl-C) closes the link: a server that stopped answering, with the link
    still up, must not hold it for the link's timeout or the client's."""
    server = ServerProcess("--l1-size-gb", "0.05")  # a small pool: a quick start
    try:
        link = ServerLink(server.endpoint, timeout_s=30)
        assert link.connect()
        freeze(server.pid)
        started = time.monotonic()
        link.close()
        assert time.monotonic() - started < 5.0
    finally:
        server.proc.send_signal(signal.SIGCONT)
        assert server.stop() == 0

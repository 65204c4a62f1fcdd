"""Every stop is bounded: a server whose tier lookup never ends, a client of a frozen server, a ZMQ context with
a socket left open; and the signal handling of `kvferry server` (a second signal exits at once)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

import pytest
import zmq

from kvferry.cache import CacheNamespace, LookupResult
from kvferry.cache.keys import TokenIds
from kvferry.client import KvferryClient
from kvferry.client.client import CLOSE_TIMEOUT_S
from kvferry.config import ServerConfig
from kvferry.server import KvferryServer
from kvferry.server.app import StopSignals
from kvferry.stopping import term_context
from tests.server.serverkit import FakeEngine, ServerProcess, freeze, wait_for

KEY_SPACE = {"model": "m", "kv_dtype": "bfloat16", "layout": "fake:3"}


class FrozenTierEngine(FakeEngine):
    """A cache whose tier stopped answering: a lookup's tier half waits until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def lookup_pool(
        self,
        tokens: TokenIds,
        *,
        namespace: CacheNamespace | None = None,
        lock: bool = False,
        block_size: int | None = None,
        first_chunk: int = 0,
        locate: bool = False,
    ) -> tuple[LookupResult, Callable[[], LookupResult] | None]:
        missed = LookupResult(0, 0, None)

        def never_answers() -> LookupResult:
            self.release.wait(60)
            return missed

        return missed, never_answers


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_server_stop_gives_up_on_a_tier_lookup_that_never_ends() -> None:
    engine = FrozenTierEngine()
    server = KvferryServer(ServerConfig(port=0, http_port=None, tier_workers=1), engine)
    server.start()
    try:
        with KvferryClient(f"tcp://127.0.0.1:{server.port}", timeout_s=30) as client:
            pending = client.lookup_async(list(range(8)), namespace=KEY_SPACE)
            wait_for(lambda: any(t.name.startswith("kvferry-tier") for t in threading.enumerate()), "the lookup")
            started = time.monotonic()
            assert server.stop(timeout_s=1.0) is False  # it says it left a thread behind
            assert time.monotonic() - started < 4.0
            with pytest.raises(ConnectionError):  # never answered: its client sees the connection drop
                pending.result(timeout=40)
    finally:
        engine.release.set()
    loop = server._loop_thread
    assert loop is not None
    loop.join(30)  # the loop left behind ends quietly once the lookup does, its context gone
    assert not loop.is_alive()


def test_a_client_of_a_frozen_server_closes_without_waiting_for_it() -> None:
    server = ServerProcess("--l1-size-gb", "0.05")  # a small pool: a quick start
    try:
        client = KvferryClient(server.endpoint, timeout_s=30)
        client.ping()
        freeze(server.pid)
        started = time.monotonic()
        client.close()  # its END_SESSION gets no answer: not waited for past the close's bound
        assert time.monotonic() - started < CLOSE_TIMEOUT_S + 2.0
    finally:
        server.proc.send_signal(signal.SIGCONT)
        assert server.stop() == 0


def test_a_context_with_a_socket_left_open_is_given_up_on_at_the_deadline() -> None:
    context = zmq.Context()
    sock = context.socket(zmq.PULL)
    started = time.monotonic()
    assert term_context(context, time.monotonic() + 0.5) is False
    assert time.monotonic() - started < 3.0
    sock.close(linger=0)  # the termination left behind then finishes
    wait_for(lambda: context.closed, "the context to terminate")


def test_the_first_signal_asks_for_a_stop_and_a_second_exits_at_once() -> None:
    exits: list[int] = []
    signals = StopSignals(exit_now=exits.append)
    signals.handle(signal.SIGINT, None)
    assert signals.received == [signal.SIGINT] and exits == []
    signals.handle(signal.SIGTERM, None)
    assert exits == [128 + signal.SIGTERM]

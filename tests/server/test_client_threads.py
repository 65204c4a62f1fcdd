"""The client's socket shared by threads: a synchronous call reads its own reply on its own thread, and callers
on many threads at once, synchronous and asynchronous, all get their replies without waiting on a missed wake-up."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest

from kvferry.client import KvferryClient
from kvferry.client import connection as connection_module
from kvferry.protocol.messages import Op

KEY_SPACE = {"model": "m", "kv_dtype": "bfloat16", "layout": "fake:3"}


def test_a_synchronous_call_reads_its_reply_on_its_own_thread(client: KvferryClient) -> None:
    assert client.wait_available(5)
    settled_on: list[int] = []

    def send() -> Future[Any]:
        future = client._conn.submit(Op.PING, {})
        future.add_done_callback(lambda _: settled_on.append(threading.get_ident()))
        return future

    for _ in range(20):
        assert client._conn.call(send)["version"] == 1
    assert settled_on == [threading.get_ident()] * 20  # never by the background thread: no hop between threads


def test_many_threads_sync_and_async_get_every_reply_promptly(
    client: KvferryClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wake-up lost between the threads would show as a call as long as the leader's recheck, made 5 s here."""
    monkeypatch.setattr(connection_module, "_LEADER_RECHECK_S", 5.0)
    assert client.wait_available(5)
    slowest: list[float] = []
    errors: list[BaseException] = []

    def sync_caller(seed: int) -> None:
        try:
            worst = 0.0
            for i in range(150):
                started = time.monotonic()
                if i % 2:
                    client.ping()
                else:
                    client.lookup([seed, i, 1, 2, 3, 4, 5, 6], namespace=KEY_SPACE)
                worst = max(worst, time.monotonic() - started)
            slowest.append(worst)
        except BaseException as exc:
            errors.append(exc)

    def async_caller() -> None:
        try:
            worst = 0.0
            for i in range(60):
                started = time.monotonic()
                window = [client.lookup_async([i, j, 7, 7], namespace=KEY_SPACE) for j in range(8)]
                for future in window:
                    future.result(timeout=10)
                worst = max(worst, time.monotonic() - started)
            slowest.append(worst)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=sync_caller, args=(s,)) for s in range(3)]
    threads += [threading.Thread(target=async_caller) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and len(slowest) == 5
    assert max(slowest) < 2.0, slowest

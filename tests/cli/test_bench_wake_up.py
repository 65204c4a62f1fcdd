"""The host wake-up figure the GPU benchmarks print (`kvferry.bench.timing.wake_up_us`): what it times is a
thread woken by a send, not the sender's own pace."""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest

from kvferry.bench import timing


def test_a_wake_up_is_timed_from_the_send_to_the_woken_thread() -> None:
    us = timing.wake_up_us(samples=20, gap_s=0.001)
    assert 0 < us < 50_000  # a busy 2-core CI machine takes far less than 50 ms to switch threads


def test_a_receiver_that_wakes_late_shows_in_the_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    real = socket.socket.recv

    class SlowToWake(socket.socket):
        def recv(self, *args: Any) -> bytes:
            data = real(self, *args)
            time.sleep(0.005)  # the thread runs 5 ms after its data arrived
            return data

    pair = socket.socketpair

    def slow_pair() -> tuple[socket.socket, socket.socket]:
        a, b = pair()
        slow = SlowToWake(b.family, b.type, fileno=b.detach())
        return a, slow

    monkeypatch.setattr(timing.socket, "socketpair", slow_pair)
    assert timing.wake_up_us(samples=5, gap_s=0.001) >= 5_000


def test_the_line_says_the_figure_and_who_pays_it() -> None:
    line = timing.wake_up_line(171.6, ", and a load one more")
    assert "172 us" in line and line.endswith("one more")


def test_the_line_says_when_the_server_polled_instead() -> None:
    line = timing.wake_up_line(171.6, "; a load pays one more", busy_poll_us=500)
    assert "172 us" in line and "polled 500 us" in line and "waits for one such" not in line
    assert line.endswith("one more")

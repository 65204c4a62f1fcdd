"""Descriptors over a SOCK_SEQPACKET pair (`kvferry.protocol.fd_passing`): what a reader takes and what it refuses,
each refused message's descriptors closed. memfds stand in for the driver's exported allocations."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import msgpack
import pytest

from kvferry.protocol import fd_passing
from kvferry.protocol.fd_passing import FdPassingError, close_all, pack, receive


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a.settimeout(5)
    b.settimeout(5)
    with a, b:
        yield a, b


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def memfd(content: bytes) -> int:
    fd = os.memfd_create("kv")
    os.write(fd, content)
    return fd


def test_a_message_and_its_descriptors_arrive_as_the_same_files(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    contents = [os.urandom(64) for _ in range(3)]
    sent = [memfd(c) for c in contents]
    socket.send_fds(a, [pack({"total": 3})], sent)
    close_all(sent)
    message, fds = receive(b)
    try:
        assert message == {"total": 3}
        assert [os.pread(fd, 64, 0) for fd in fds] == contents
    finally:
        close_all(fds)


def test_the_end_of_the_stream_is_an_empty_message(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.shutdown(socket.SHUT_WR)
    assert receive(b) == ({}, [])


@pytest.mark.parametrize(
    "payload",
    [b"\xc1 not msgpack", msgpack.packb([1, 2]), os.urandom(fd_passing.MAX_MESSAGE_BYTES + 1)],
    ids=["malformed", "not-a-map", "oversized"],
)
def test_a_bad_message_is_refused_and_its_descriptors_closed(
    pair: tuple[socket.socket, socket.socket], payload: bytes
) -> None:
    a, b = pair
    before = open_fds()
    sent = [memfd(b"x"), memfd(b"y")]
    socket.send_fds(a, [payload], sent)
    close_all(sent)
    with pytest.raises(FdPassingError):
        receive(b)
    assert open_fds() == before


def test_more_descriptors_than_a_message_takes_are_refused_and_all_closed(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    before = open_fds()
    sent = [memfd(b"z") for _ in range(fd_passing.MAX_FDS_PER_MESSAGE + 2)]
    socket.send_fds(a, [pack({"total": len(sent)})], sent)
    close_all(sent)
    with pytest.raises(FdPassingError, match="descriptors"):
        receive(b)
    assert open_fds() == before


def test_send_deposit_splits_into_messages_and_reads_the_token(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    sent = [memfd(bytes([i % 256])) for i in range(fd_passing.MAX_FDS_PER_MESSAGE + 7)]
    token = os.urandom(fd_passing.TOKEN_BYTES)
    got: list[int] = []
    try:
        b.sendall(pack({"token": token}))  # the reply waits in the socket while the deposit is sent
        assert fd_passing.send_deposit(a, sent) == token
        while len(got) < len(sent):
            message, fds = receive(b)
            assert message == {"total": len(sent)}
            got += fds
        assert [os.pread(fd, 1, 0) for fd in got] == [bytes([i % 256]) for i in range(len(sent))]
    finally:
        close_all(sent + got)


def test_send_deposit_raises_the_server_s_refusal(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    fd = memfd(b"k")
    try:
        b.sendall(pack({"error": "the client runs as uid 7"}))
        with pytest.raises(FdPassingError, match="uid 7"):
            fd_passing.send_deposit(a, [fd])
        with pytest.raises(FdPassingError, match=r"1\.\.4096"):
            fd_passing.send_deposit(a, [])
    finally:
        os.close(fd)


def test_the_descriptor_socket_sits_beside_the_request_socket() -> None:
    assert fd_passing.fd_socket_path("/run/kvferry/server.sock") == "/run/kvferry/server.sock.fds"

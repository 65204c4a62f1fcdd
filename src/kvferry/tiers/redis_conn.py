"""redis-py plumbing for chunk-sized values (megabytes each), used by the Redis tier's clients.

Two things redis-py does not do well for such values, fixed here through its public hooks (a connection class
with its own command packer and reply parser):
- a value made of a header and a tensor's bytes is sent as those two buffers (`SplitValue`), without first
  joining them into one new bytes object;
- a large reply is received with `recv_into` into one buffer sized from the reply's length, instead of
  64 KiB recv() calls appended to a growing BytesIO (measured here: 32 MiB GETs ran ~6x slower that way).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import redis
from redis._parsers import Encoder, _RESP2Parser
from redis._parsers.socket import SERVER_CLOSED_CONNECTION_ERROR, SocketBuffer
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import PythonRespSerializer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.retry import Retry
from redis.utils import SENTINEL

if TYPE_CHECKING:
    from typing_extensions import Buffer

# Replies at least this long are read with recv_into; smaller ones go through redis-py's buffer.
LARGE_REPLY_BYTES = 256 << 10
_BUFFER_CUTOFF = 6000  # redis-py's own threshold for sending an argument as a separate buffer


class SplitValue:
    """One Redis string argument sent as several buffers (header, payload), not concatenated."""

    __slots__ = ("nbytes", "parts")

    def __init__(self, *parts: bytes | memoryview) -> None:
        self.parts = parts
        self.nbytes = sum(len(part) for part in parts)


class _SplitValuePacker:
    """RESP command packer that understands SplitValue; every other command is packed as redis-py does."""

    def __init__(self) -> None:
        self._plain = PythonRespSerializer(_BUFFER_CUTOFF, Encoder("utf-8", "strict", False).encode)

    def pack(self, *args: object) -> list[bytes | memoryview]:
        if not any(isinstance(arg, SplitValue) for arg in args):
            return self._plain.pack(*args)
        output: list[bytes | memoryview] = []
        pending = b"*%d\r\n" % len(args)
        for arg in args:
            if isinstance(arg, SplitValue):
                output.append(pending + b"$%d\r\n" % arg.nbytes)
                output.extend(arg.parts)
                pending = b"\r\n"
            else:
                # The other arguments of a SplitValue command (SET and its key) are str or bytes.
                data = arg.encode() if isinstance(arg, str) else bytes(cast("Buffer", arg))
                pending += b"$%d\r\n%s\r\n" % (len(data), data)
        output.append(pending)
        return output


class _LargeReplySocketBuffer(SocketBuffer):
    # A large reply is a memoryview of the buffer it was read into, not bytes: the tier takes either.
    def read(self, length: int, timeout: object = SENTINEL) -> bytes | memoryview:  # type: ignore[override]
        if length < LARGE_REPLY_BYTES:
            return super().read(length, timeout)
        # np.empty: no zero-fill pass over a buffer that recv_into overwrites anyway.
        view = np.empty(length + 2, dtype=np.uint8).data
        got = self._buffer.readinto(view)  # whatever redis-py had already buffered
        if timeout is not SENTINEL:
            self._sock.settimeout(cast("float | None", timeout))  # anything but SENTINEL is a timeout
        try:
            while got < len(view):
                n = self._sock.recv_into(view[got:])
                if n == 0:
                    raise RedisConnectionError(SERVER_CLOSED_CONNECTION_ERROR)
                got += n
        finally:
            if timeout is not SENTINEL:
                self._sock.settimeout(self.socket_timeout)
        return view[:length]


class _LargeReplyParser(_RESP2Parser):
    def on_connect(self, connection: redis.Connection) -> None:
        super().on_connect(connection)
        assert self._sock is not None  # the connected socket, which on_connect just took from `connection`
        # SocketBuffer's annotation says float, but its timeout is a socket's: None (blocking) too, as redis-py's
        # own parsers pass it.
        timeout = connection.socket_timeout
        self._buffer = _LargeReplySocketBuffer(self._sock, self.socket_read_size, timeout)  # type: ignore[arg-type]


class ChunkConnection(redis.Connection):
    """A redis-py connection that sends SplitValue arguments and reads large replies in one buffer.
    A large bulk reply comes back as a read-only-by-convention memoryview instead of bytes."""

    def __init__(self, **kwargs: object) -> None:
        kwargs.setdefault("command_packer", _SplitValuePacker())
        kwargs.setdefault("parser_class", _LargeReplyParser)
        super().__init__(**kwargs)


def make_client(
    nodes: Sequence[tuple[str, int]],
    *,
    cluster: bool,
    db: int = 0,
    username: str | None = None,
    password: str | None = None,
    timeout_s: float,
    connect_timeout_s: float,
) -> redis.Redis | RedisCluster:
    """A client that fails fast: no redis-py retries, since the tier's health gate owns retrying."""
    common: dict[str, Any] = {
        "username": username,
        "password": password,
        "socket_timeout": timeout_s,
        "socket_connect_timeout": connect_timeout_s,
        "connection_class": ChunkConnection,
        "protocol": 2,  # the large-reply parser is a RESP2 parser (redis-py 8 defaults to RESP3)
    }
    if cluster:
        # redis-py builds the per-node pools with our connection class only when it is given a url.
        host, port = nodes[0]
        return RedisCluster(
            url=f"redis://[{host}]:{port}" if ":" in host else f"redis://{host}:{port}",
            startup_nodes=[ClusterNode(h, p) for h, p in nodes[1:]],
            retry=Retry(NoBackoff(), 0),
            **common,
        )
    ((host, port),) = nodes
    pool = redis.ConnectionPool(host=host, port=port, db=db, retry=Retry(NoBackoff(), 0), **common)
    return redis.Redis(connection_pool=pool, retry=Retry(NoBackoff(), 0))

"""Redis / Valkey tier (standalone or Redis Cluster) through redis-py, shared by many kvferry processes.

One string value per object: header + tensor bytes (see header.py), under `prefix + {tag} + key` where the
tag is a hash of the key: in a cluster the `{...}` hash tag spreads objects evenly over the slots whatever
bytes the keys contain, and every process computes the same name. Requests from many threads are pipelined
(see batching.py). A GET is verified on the received bytes before the pool is asked for memory, then copied
once into the tensor from `alloc`. The tier sets no TTL and does no eviction of its own: configure the server
with `maxmemory` and `maxmemory-policy allkeys-lru`; a server out of memory makes puts return False.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import blake3
import redis
import torch
from redis.cluster import RedisCluster
from redis.exceptions import (
    ClusterDownError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)

from kvferry.tiers.base import Alloc, Free, Tier, TierFull, TierUnavailable, resolved
from kvferry.tiers.batching import Batcher
from kvferry.tiers.header import (
    CorruptObject,
    decode_header,
    destination_bytes,
    encode_header,
    verify_payload,
)
from kvferry.tiers.redis_conn import SplitValue, make_client


@dataclass(eq=False)
class _Request:
    key: bytes
    nbytes: int
    miss: object
    future: Future = field(default_factory=Future)
    obj: torch.Tensor | None = None  # put
    payload: memoryview | None = None  # put
    alloc: Alloc | None = None  # get
    free: Free | None = None  # get


class RedisTier(Tier):
    locality = "REMOTE"  # one store that many nodes share

    def __init__(
        self,
        nodes: Sequence[tuple[str, int]],
        *,
        cluster: bool = False,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        prefix: bytes = b"kvferry:",
        workers: int = 2,
        timeout_s: float = 5.0,
        connect_timeout_s: float = 1.0,
        max_batch: int = 16,
        max_batch_bytes: int = 64 << 20,
        name: str | None = None,
        backoff_s: float = 1.0,
        backoff_max_s: float = 60.0,
    ) -> None:
        """`nodes`: one (host, port) standalone; any number of seed nodes for a cluster. `timeout_s` bounds
        each socket read/write, so a slow server turns into misses rather than stuck callers."""
        if not nodes or (not cluster and len(nodes) != 1):
            raise ValueError(f"nodes={list(nodes)}: give one (host, port), or seed nodes with cluster=True")
        if b"{" in prefix or b"}" in prefix:
            raise ValueError(f"prefix={prefix!r} must not contain '{{' or '}}' (it would change cluster slots)")
        if timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} and connect_timeout_s={connect_timeout_s} must be > 0")
        scheme = "redis+cluster" if cluster else "redis"
        default_name = f"{scheme}://" + ",".join(f"{h}:{p}" for h, p in nodes) + (f"/{db}" if db else "")
        super().__init__(name or default_name, backoff_s=backoff_s, backoff_max_s=backoff_max_s)
        self._client_args: dict[str, Any] = {
            "nodes": list(nodes),
            "cluster": cluster,
            "db": db,
            "username": username,
            "password": password,
            "timeout_s": timeout_s,
            "connect_timeout_s": connect_timeout_s,
        }
        self.cluster = cluster
        self._prefix = prefix
        self._client: redis.Redis | RedisCluster | None = None
        self._client_lock = threading.Lock()
        self._typical_bytes = 0  # size of the last object seen; a get is assumed to move that much
        self._used: int | None = None  # what the server(s) reported at the last check
        self._batcher = Batcher(
            self._run_batch,
            workers=workers,
            max_items=max_batch,
            max_bytes=max_batch_bytes,
            name="kvferry-redis",
        )

    @property
    def capacity_bytes(self) -> None:
        return None

    @property
    def used_bytes(self) -> int | None:
        """Memory the server(s) reported in use (all primaries of a cluster) at the last `check()`; None while
        unhealthy or before the first check."""
        return self._used if self.healthy else None

    def _check(self) -> bool:
        try:
            client = self._connect()
            if isinstance(client, RedisCluster):
                infos = client.info("memory", target_nodes=RedisCluster.PRIMARIES).values()
                used = sum(int(info["used_memory"]) for info in infos)
            else:
                used = int(client.info("memory")["used_memory"])
        except Exception as exc:
            self._used = None
            self._metrics.set_usage(None, None)
            raise _classify(exc) from exc
        self._used = used
        self._metrics.set_usage(used, None)
        return True

    def evict(self, nbytes: int) -> int:
        """Redis evicts by its own maxmemory-policy; the tier frees nothing itself."""
        return 0

    def close(self) -> None:
        super().close()
        self._batcher.close()
        with self._client_lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    # --- requests -----------------------------------------------------------------------------------------

    def _submit_put(self, key: bytes, obj: torch.Tensor, payload: memoryview) -> Future[bool]:
        request = _Request(key, len(payload), False, obj=obj, payload=payload)
        return request.future if self._batcher.submit(request) else resolved(False)

    def _submit_get(self, key: bytes, alloc: Alloc, free: Free | None) -> Future[torch.Tensor | None]:
        request = _Request(key, self._typical_bytes, None, alloc=alloc, free=free)
        return request.future if self._batcher.submit(request) else resolved(None)

    def _contains(self, keys: list[bytes]) -> list[bool]:
        try:
            pipe = self._connect().pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._redis_key(key))
            return [bool(n) for n in pipe.execute()]
        except Exception as exc:
            raise _classify(exc) from exc

    def _delete(self, key: bytes) -> None:
        self._forget([self._object_name(key)])
        try:
            self._connect().delete(self._redis_key(key))
        except Exception as exc:
            raise _classify(exc) from exc

    def _run_batch(self, batch: list[_Request]) -> None:
        """One pipeline for the whole batch; then each request is finished on its own reply."""
        started = time.perf_counter()
        try:
            pipe = self._connect().pipeline(transaction=False)
            for request in batch:
                if request.payload is not None:
                    assert request.obj is not None  # a put holds the object its payload views
                    header = encode_header(request.key, request.obj, request.payload)
                    pipe.execute_command("SET", self._redis_key(request.key), SplitValue(header, request.payload))
                else:
                    pipe.execute_command("GET", self._redis_key(request.key))
            replies = pipe.execute(raise_on_error=False)
        except Exception as exc:
            error = _classify(exc)
            if isinstance(error, TierUnavailable) and self.cluster:
                self._drop_client()  # rediscover the topology on the next probe
            for request in batch:
                self._record_failure("put" if request.payload is not None else "get", error)
                request.future.set_result(request.miss)
            return
        for request, reply in zip(batch, replies, strict=True):
            op = "put" if request.payload is not None else "get"
            try:
                result: object = (
                    self._finish_put(request, reply, started)
                    if op == "put"
                    else self._finish_get(request, reply, started)
                )
            except Exception as exc:  # e.g. alloc raised: this request is a miss, the others go on
                self._record_failure(op, exc)
                result = request.miss
            request.future.set_result(result)

    def _finish_put(self, request: _Request, reply: object, started: float) -> bool:
        if isinstance(reply, Exception):
            self._record_failure("put", _classify(reply))
            return False
        self._typical_bytes = request.nbytes
        self._record_success("put", "stored", request.nbytes, started)
        return True

    def _finish_get(self, request: _Request, reply: object, started: float) -> torch.Tensor | None:
        if isinstance(reply, Exception):
            self._record_failure("get", _classify(reply))
            return None
        if reply is None:
            self._record_success("get", "miss")
            self._forget([self._object_name(request.key)])  # gone: evicted by Redis, or deleted by another node
            return None
        try:
            if not isinstance(reply, (bytes, memoryview)):
                raise CorruptObject(f"GET returned {type(reply).__name__}, expected bytes")
            header = decode_header(request.key, reply)
            payload = memoryview(reply)[header.header_len :]
            verify_payload(header, payload)
        except CorruptObject as exc:
            self._record_corrupt(request.key, exc)
            return None
        self._typical_bytes = len(payload)
        assert request.alloc is not None  # every get gives its allocator
        tensor = request.alloc(header.shape, header.dtype)
        if tensor is None:
            self._record_success("get", "no_memory")
            return None
        try:
            destination_bytes(tensor, header)[:] = payload
        except Exception as exc:
            if request.free is not None:
                request.free(tensor)
            self._record_failure("get", exc)
            return None
        self._record_success("get", "hit", len(payload), started)
        return tensor

    # --- client -------------------------------------------------------------------------------------------

    def _redis_key(self, key: bytes) -> bytes:
        return b"%s{%s}%s" % (self._prefix, blake3.blake3(key).hexdigest(8).encode(), key)

    def _connect(self) -> redis.Redis | RedisCluster:
        """The client, created on first use: a cluster client connects (and can fail) while being built."""
        with self._client_lock:
            if self._client is None:
                try:
                    self._client = make_client(**self._client_args)
                except (RedisError, RedisClusterException, OSError) as exc:
                    raise TierUnavailable(f"cannot reach {self.name}: {exc}") from exc
            return self._client

    def _drop_client(self) -> None:
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):  # best effort: it is already broken
                client.close()


def _classify(exc: BaseException) -> BaseException:
    """Server out of memory -> full; unreachable, slow, loading or a cluster without a primary -> unavailable;
    anything else (a protocol surprise, a bug) stays itself and is counted as an error."""
    if isinstance(exc, OutOfMemoryError):
        return TierFull(str(exc))
    if isinstance(exc, (ClusterDownError, TryAgainError, ReadOnlyError)) or (
        isinstance(exc, (RedisError, RedisClusterException, OSError)) and not isinstance(exc, ResponseError)
    ):
        return TierUnavailable(f"{type(exc).__name__}: {exc}")
    return exc

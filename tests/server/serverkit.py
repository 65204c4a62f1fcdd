"""Helpers for the server tests: a tiny stand-in for CacheEngine, a server subprocess, client processes.

The fake engine lets the server's protocol, sessions and memory mapping be tested alone. It keeps whole
chunks of the first `[NB, BS, W]` tensor of an NL_X_NB_BS_HS KV in a dict keyed by (namespace, token prefix),
which is enough to check that the server reads and writes the client's memory through its mapping. `gate`
lets a test hold a transfer mid-way (to end a session under it); `tier_seconds` makes every lookup that misses
in the pool ask a tier that takes that long to answer (a frozen Redis, say).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch
from prometheus_client import CollectorRegistry, Counter

from kvferry.cache import CacheNamespace, Located, LookupResult, token_bytes
from kvferry.cache.event_hooks import EventSource
from kvferry.cache.event_queue import EventQueue
from kvferry.cache.keys import TokenIds
from kvferry.cache.steps import Steps
from kvferry.formats import EngineKVFormat, KVGeometry
from kvferry.protocol.unix_framing import HEADER, frame
from kvferry.tiers import Tier
from kvferry.transfer.block_ids import BlockIds


class NoPool:
    """`CacheService.written` of a cache with no pool to reserve objects in."""

    def reserve(self, geom: KVGeometry, count: int) -> list[int]:
        raise ValueError("the fake engine has no pool")

    def give_back(self, offsets: Sequence[int]) -> None:
        raise ValueError("the fake engine has no pool")

    def adopt(
        self,
        tokens: TokenIds,
        ns: CacheNamespace,
        geom: KVGeometry,
        first: int,
        offsets: Sequence[int],
        tail: tuple[int, int] | None,
    ) -> int:
        raise ValueError("the fake engine has no pool")


class FakeEngine:
    """The cache engine as the server sees it (`CacheService`: mypy checks this class against it)."""

    def __init__(self, chunk_size: int = 4) -> None:
        self.chunk_size = chunk_size
        self.objects: dict[tuple[bytes, bytes], torch.Tensor] = {}
        self.locks: set[int] = set()
        self.gate = threading.Event()
        self.gate.set()
        self.in_transfer = threading.Event()
        self._next_lock = 1
        self.metrics_registry = CollectorRegistry()
        self.fake_calls = Counter("fake_engine_calls", "calls", registry=self.metrics_registry)
        self.stores = 0  # store calls that got past the gate
        self.tiers: list[Tier] = []
        self.codec = "none"  # the objects' default codec (`CacheEngine.codec`)
        self.tier_seconds = 0.0
        self.pool_gate = threading.Event()  # cleared: lookups wait (on the socket thread) until it is set
        self.pool_gate.set()
        self.retrieve_gate = threading.Event()  # cleared: retrieves wait (on their worker) until it is set
        self.retrieve_gate.set()

    def namespace_for(
        self,
        model: str,
        fmt: EngineKVFormat | int,
        paged: Any,
        *,
        world_size: int = 1,
        rank: int = 0,
        salt: str = "",
        block_size: int | None = None,
        geometry: KVGeometry | None = None,
        codec: str | None = None,
        kv_cache_dtype: str | None = None,
        group: str | None = None,
        split: str | None = None,
    ) -> CacheNamespace:
        first = paged if isinstance(paged, torch.Tensor) else paged[0]
        dtype, layout, codec = str(first.dtype), f"fake:{int(fmt)}", codec or self.codec
        return CacheNamespace(
            model, dtype, layout, world_size, rank, salt, codec, kv_cache_dtype=kv_cache_dtype, group=group, split=split
        )

    def _keys(self, tokens: TokenIds, namespace: CacheNamespace | None) -> list[tuple[bytes, bytes]]:
        if namespace is None:
            raise ValueError("the fake engine has no default key space: name one")
        data = token_bytes(tokens)
        step = self.chunk_size * 4
        return [(namespace.digest, data[: end + step]) for end in range(0, len(data) // step * step, step)]

    def _page_keys(self, tokens: TokenIds, namespace: CacheNamespace | None) -> list[tuple[bytes, bytes]]:
        """Each chunk keyed alone (a retrieve or store of pages)."""
        c = self.chunk_size
        return [k for i in range(len(tokens) // c) for k in self._keys(tokens[i * c : (i + 1) * c], namespace)]

    def lookup_status(
        self, tokens: TokenIds, *, namespace: CacheNamespace | None = None, lock: bool = False
    ) -> LookupResult:
        found, below = self.lookup_pool(tokens, namespace=namespace, lock=lock)
        return found if below is None else below()

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
        assert not locate, "the server locates only out of a shared pool, which the fake has not"
        found = self._pool_lookup(tokens, namespace, lock, first_chunk)
        if not self.tier_seconds or found.hit_tokens == len(tokens) // self.chunk_size * self.chunk_size:
            return found, None

        def slow_tier() -> LookupResult:
            time.sleep(self.tier_seconds)
            return found

        return found, slow_tier

    def _pool_lookup(
        self, tokens: TokenIds, namespace: CacheNamespace | None, lock: bool, first_chunk: int = 0
    ) -> LookupResult:
        self.pool_gate.wait()
        self.fake_calls.inc()
        keys = self._keys(tokens, namespace)
        hits = min(first_chunk, len(keys))  # the chunks before it count as held, as CacheEngine's do
        for key in keys[hits:]:
            if key not in self.objects:
                break
            hits += 1
        lock_id = None
        if lock and hits:
            lock_id = self._next_lock
            self._next_lock += 1
            self.locks.add(lock_id)
        return LookupResult(hits * self.chunk_size, 0, lock_id)

    def store_steps(
        self,
        tokens: TokenIds,
        paged: Any,
        block_ids: BlockIds,
        fmt: EngineKVFormat | int,
        *,
        namespace: CacheNamespace | None = None,
        block_size: int | None = None,
        skip_prefix_tokens: int = 0,
        geometry: KVGeometry | None = None,
        valid_until: float | None = None,
        tail: bool = False,  # the fake keeps full chunks only
        pages: bool = False,
    ) -> Steps[int]:
        """Copies on its first step and ends there, as a CPU copy does (`kvferry.cache.steps`)."""
        self.in_transfer.set()
        self.gate.wait()
        self.stores += 1
        keys = self._page_keys(tokens, namespace) if pages else self._keys(tokens, namespace)
        per = self.chunk_size // paged[0].shape[1]
        if len(block_ids) < len(keys) * per:
            raise ValueError(f"block_ids has {len(block_ids)} entries, need {len(keys) * per}")
        ids = _block_tensor(block_ids)
        for i, key in enumerate(keys):
            self.objects[key] = paged[0][ids[i * per : (i + 1) * per]].clone()
        yield from ()
        return len(keys) * self.chunk_size

    def retrieve_steps(
        self,
        tokens: TokenIds,
        paged: Any,
        block_ids: BlockIds,
        fmt: EngineKVFormat | int,
        *,
        namespace: CacheNamespace | None = None,
        block_size: int | None = None,
        skip_prefix_tokens: int = 0,
        lock_id: int | None = None,
        geometry: KVGeometry | None = None,
        pages: bool = False,
    ) -> Steps[int]:
        self.in_transfer.set()
        self.retrieve_gate.wait()
        per = self.chunk_size // paged[0].shape[1]
        ids = _block_tensor(block_ids)
        done = 0
        keys = self._page_keys(tokens, namespace) if pages else self._keys(tokens, namespace)
        for i, key in enumerate(keys):
            if key not in self.objects:
                break
            paged[0][ids[i * per : (i + 1) * per]] = self.objects[key]
            done += self.chunk_size
        if lock_id is not None:
            self.locks.discard(lock_id)
        yield from ()
        return done

    def prefetch(self, tokens: TokenIds, *, namespace: CacheNamespace | None = None) -> Future[int]:
        future: Future[int] = Future()
        future.set_result(self.lookup_status(tokens, namespace=namespace).hit_tokens)
        return future

    def demote(self, tokens: TokenIds, chunks: range, *, namespace: CacheNamespace | None = None) -> None:
        self._keys(tokens, namespace)  # the fake keeps no eviction order: it only checks the arguments

    @property
    def shared_pool(self) -> tuple[int, int] | None:
        return None  # the fake keeps whole objects in a dict, no pool

    @property
    def not_locatable(self) -> str | None:
        return None  # nothing refuses it: no pool is shared (`shared_pool`)

    @property
    def written(self) -> NoPool:
        return NoPool()  # the server asks a cache with no shared pool for no reserved objects

    def locate(
        self, tokens: TokenIds, *, namespace: CacheNamespace | None = None, block_size: int | None = None
    ) -> Located:
        raise ValueError("the fake engine has no pool to locate objects in")

    def free_lookup_locks(self, lock_id: int) -> bool:
        if lock_id in self.locks:
            self.locks.discard(lock_id)
            return True
        return False

    def free_lookup_locks_many(self, lock_ids: Iterable[int]) -> int:
        return sum(map(self.free_lookup_locks, lock_ids))

    def publish_events(self, queue: EventQueue) -> EventSource:
        raise RuntimeError("the fake engine reports no KV events (its server runs without an events port)")

    def clear(self) -> None:
        self.objects.clear()

    def stats(self) -> dict[str, Any]:
        return {"objects": len(self.objects), "locks": len(self.locks)}

    def close(self) -> None:
        pass


def _block_tensor(block_ids: BlockIds) -> torch.Tensor:
    return torch.as_tensor(np.asarray(block_ids, dtype=np.int64))


NB, BS, W = 32, 2, 8  # fake-engine KV: [NB, BS, W] bf16; a 4-token chunk is 2 blocks


def random_kv(seed: int) -> list[torch.Tensor]:
    """One layer of NL_X_NB_BS_HS KV, random bf16."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(NB, BS, W, generator=gen).to(torch.bfloat16)]


def wait_for(predicate: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)


def freeze(pid: int) -> None:
    """SIGSTOP `pid` and return once it is stopped (the signal is delivered asynchronously)."""
    import os
    import signal

    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: process_state(pid) == "T", f"process {pid} to stop", 5.0)


def process_state(pid: int) -> str:
    """The one-letter state of `pid` (R, S, T, Z, ...) from /proc; "" once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return ""


def raw_request(endpoint: str, op: str, args: dict[str, Any]) -> dict[str, Any]:
    """One request over a bare DEALER socket, or the bare Unix socket of an ipc:// endpoint (what a client library
    would refuse to send)."""
    import msgpack
    import zmq

    request = msgpack.packb({"v": 1, "id": 1, "op": op, "args": args})
    if endpoint.startswith("ipc://"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix:
            unix.settimeout(10)
            unix.connect(endpoint.removeprefix("ipc://"))
            unix.sendall(frame(request))
            return msgpack.unpackb(read_frame(unix))
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        sock.send(request)
        assert sock.poll(10_000), f"no reply to {op}"
        return msgpack.unpackb(sock.recv())


def read_frame(unix: socket.socket) -> bytes:
    """One frame off a bare Unix socket client (kvferry.protocol.unix_framing)."""
    (size,) = HEADER.unpack(_read_exactly(unix, HEADER.size))
    return _read_exactly(unix, size)


def _read_exactly(unix: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = unix.recv(n - len(data))
        assert more, "the server closed the connection"
        data += more
    return data


def shm_name(tensor: torch.Tensor) -> str:
    """The shared-memory name ("/torch_...") of a CPU tensor a client registered (torch's fd strategy: the
    file is unlinked, so the name only shows through the descriptor and in /proc/<pid>/maps)."""
    fd, _ = tensor.untyped_storage()._share_fd_cpu_()  # the descriptor torch already holds
    return os.readlink(f"/proc/self/fd/{fd}").removeprefix("/dev/shm").removesuffix(" (deleted)")


def shm_mappings(name: str, pid: int | str = "self") -> int:
    """Mappings of shared-memory file `name` ("/torch_...") in process `pid`, unlinked ones included."""
    path = "/dev/shm" + name
    with open(f"/proc/{pid}/maps") as maps:
        return sum(line.rstrip().removesuffix(" (deleted)").endswith(path) for line in maps)


# --- the real server in a subprocess, and client processes ------------------------------------------------

FMT_REAL = 1  # EngineKVFormat.NL_X_TWO_NB_BS_NH_HS: NL tensors [2, NB, BS, NH, HS]
REAL_NL, REAL_NH, REAL_HS, REAL_BS, REAL_NB, REAL_CHUNK = 4, 2, 32, 16, 96, 64
PER_CHUNK = REAL_CHUNK // REAL_BS
REAL_NS = {"model": "tests/server", "salt": "multiprocess"}


def real_kv(seed: int, nb: int = REAL_NB) -> list[torch.Tensor]:
    """Random vLLM-flash-attention-style KV: one buffer, layer outermost, like vLLM allocates it."""
    gen = torch.Generator().manual_seed(seed)
    buffer = torch.randn(REAL_NL, 2, nb, REAL_BS, REAL_NH, REAL_HS, generator=gen).to(torch.bfloat16)
    return list(buffer.unbind(0))


def blocks(kv: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    return torch.stack([layer[:, ids] for layer in kv])


class ServerProcess:
    """`python -m kvferry.server` on free ports, and a Unix socket (`ipc_endpoint`) with `ipc=True`; `stop()` sends
    SIGTERM and returns the exit status."""

    def __init__(self, *flags: str, ipc: bool = False) -> None:
        import os
        import re
        import subprocess
        import sys
        from pathlib import Path

        import kvferry

        src = str(Path(kvferry.__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
        env = {k: v for k, v in env.items() if not k.startswith("KVFERRY_")}
        cmd = [sys.executable, "-m", "kvferry.server", "--port", "0", "--http-port", "0", *flags]
        if ipc:
            import tempfile

            cmd += ["--ipc", os.path.join(tempfile.mkdtemp(prefix="kvf-"), "server.sock")]
        self.ipc_endpoint: str | None = None
        self.proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        ready = re.compile(r"ready: zmq=(tcp://[\d.]+:(\d+)) http=http://[\d.]+:(\d+)(?: ipc=(ipc://\S+))?")
        for line in self.proc.stderr:  # type: ignore[union-attr]
            self.log.append(line)
            match = ready.search(line)
            if match:
                self.endpoint, self.http_port, self.ipc_endpoint = match.group(1), int(match.group(3)), match.group(4)
                break
        else:
            raise RuntimeError("server exited before it was ready:\n" + "".join(self.log))
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            self.log.append(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> int:
        import signal

        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=30)
        self._reader.join(timeout=5)
        return code


def writer_process(endpoint: str, tokens: list[int], block_ids: list[int]) -> int:
    """Child: register KV seeded 1, store `tokens` from `block_ids`, end the session; returns tokens stored."""
    from kvferry.client import KvferryClient

    kv = real_kv(seed=1)
    with KvferryClient(endpoint) as client:
        reg = client.register_kv_cache(kv, FMT_REAL, namespace=REAL_NS)
        return client.store(reg, tokens, block_ids)


def victim_process(endpoint: str, locked_tokens: list[int], big_tokens: list[int], ready: Any) -> None:
    """Child: register, lock a cached prefix, start a large store, and die by SIGKILL mid-request."""
    import os
    import signal

    from kvferry.client import KvferryClient

    kv = real_kv(seed=3)
    client = KvferryClient(endpoint)
    reg = client.register_kv_cache(kv, FMT_REAL, namespace=REAL_NS)
    client.store(reg, big_tokens[:REAL_CHUNK], list(range(PER_CHUNK)))  # the cache has used this KV
    assert client.lookup(locked_tokens, registration=reg, lock=True).lock is not None
    ready.put(shm_name(kv[0]))
    ready.close()
    ready.join_thread()  # a Queue's put is sent by a feeder thread: flushed before the SIGKILL, never lost
    client.store_async(reg, big_tokens, list(range(len(big_tokens) // REAL_BS)))
    time.sleep(0.002)  # the frame is on its way or being served
    os.kill(os.getpid(), signal.SIGKILL)

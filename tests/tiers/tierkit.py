"""Helpers for the tier tests (imported by conftest.py and the test modules, and by spawned children)."""

from __future__ import annotations

import mmap
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis
import torch

from kvferry.tiers import make_tier
from tests.ports import free_ports

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
NO_REDIS_REASON = "redis-server / redis-cli not on PATH (apt-get install -y redis-server)"


def redis_port(*, with_cluster_bus: bool = False) -> int:
    """A loopback port for a redis-server that starts (and restarts) later (`tests.ports.free_ports`), and port +
    10000 free too for a cluster node's bus."""
    for _ in range(100):
        (port,) = free_ports(1)
        if not with_cluster_bus:
            return port
        if port + 10000 < 65536:
            with socket.socket() as bus:
                try:
                    bus.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free loopback port found")


class RedisServer:
    """One redis-server process without persistence, in its own directory; start/kill/restart at will."""

    def __init__(self, workdir: Path, *, port: int | None = None, cluster: bool = False) -> None:
        self.port = port or redis_port(with_cluster_bus=cluster)
        self.workdir = workdir / f"redis-{self.port}"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.cluster = cluster
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> RedisServer:
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir)]
        args += ["--save", "", "--appendonly", "no", "--protected-mode", "no"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            args += ["--cluster-node-timeout", "2000"]
        with open(self.workdir / "server.log", "ab") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=self.port, socket_connect_timeout=0.2).ping()
                return self
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)
        self.process = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bits of any dtype (NaN patterns included: compare with `same_bits`)."""
    gen = torch.Generator().manual_seed(seed)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).view(dtype).view(shape)


def same_bits(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return (
        a is not None
        and a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


class AlignedAlloc:
    """Page-aligned tensors, as the host pool hands out, counting allocations and frees."""

    def __init__(self) -> None:
        self.allocated = 0
        self.freed = 0
        self._buffers: list[mmap.mmap] = []

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        buffer = mmap.mmap(-1, max(nbytes, 1))
        self._buffers.append(buffer)
        self.allocated += 1
        return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)

    def free(self, tensor: torch.Tensor) -> None:
        self.freed += 1


def plain_alloc(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty: only 64-byte aligned, so O_DIRECT reads go through the bounce buffer."""
    return torch.empty(shape, dtype=dtype)


def key(i: int | str) -> bytes:
    return f"test/model/{i}".encode()


def redis_key_count(server_or_nodes: RedisServer | list[RedisServer]) -> int:
    nodes = server_or_nodes if isinstance(server_or_nodes, list) else [server_or_nodes]
    return sum(n.client().dbsize() for n in nodes)


def store_objects(urls: list[str], specs: list[tuple[str, tuple[int, ...], str, int]]) -> None:
    """Run in a spawned child process: store each (key, shape, dtype name, seed) object in every tier."""
    for url in urls:
        tier = make_tier(url)
        for name, shape, dtype, seed in specs:
            stored = tier.put(key(name), random_tensor(shape, getattr(torch, dtype), seed)).result(timeout=60)
            if not stored:
                raise SystemExit(f"put of {name} to {url} failed: {tier.stats()}")
        tier.close()

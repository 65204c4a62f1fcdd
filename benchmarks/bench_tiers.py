"""Tier throughput against the same bytes moved plainly, in the same run, on the same filesystem / server.

    python benchmarks/bench_tiers.py [--dir /var/tmp/kvferry-bench] [--total-mib 256] [--reps 3]
                                     [--redis-url redis://127.0.0.1:6379] [--out bench-out/bench_tiers.json]

Objects are chunk-shaped bf16 tensors in host pool memory: llama3-8b ([2, 32, 256, 1024], 32 MiB) and
qwen2.5-0.5b ([2, 24, 256, 128], 3 MiB); each pass moves about --total-mib of them.
Disk, per mode (O_DIRECT and buffered): the tier's put / get (workers=4, header + checksum + temp file +
rename; get verifies) against plain `os.write` / `os.readv` of the same bytes to files in the same directory,
with O_DIRECT exactly when the tier uses it, run both one file at a time and on 4 threads; the ratio is
against the faster of the two. Redis: the tier's put / get (pipelined, verified, copied into the pool)
against raw redis-py SET / GET of the same bytes, one at a time with a default client. Without --redis-url a
redis-server is started on a free loopback port (and skipped if there is none). Numbers are medians of --reps;
The checksum (xxh3-128) over the same bytes on one thread is reported too: the pass every tier put and get adds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis
import torch
import xxhash
from rich.console import Console
from rich.table import Table

from kvferry.memory import HostPool
from kvferry.tiers import DiskTier, Tier, make_tier
from kvferry.tiers.direct_io import supports_direct

MIB = 1 << 20
OBJECTS = {"llama3-8b": (2, 32, 256, 1024), "qwen2.5-0.5b": (2, 24, 256, 128)}
THREADS = 4
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _timed(fn: Callable[..., object], *args: object) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


def _put_all(tier: Tier, keys: list[bytes], objs: list[torch.Tensor]) -> list[bool]:
    return [f.result() for f in [tier.put(k, o) for k, o in zip(keys, objs, strict=True)]]


def _get_all(tier: Tier, keys: list[bytes], pool: HostPool) -> list[torch.Tensor | None]:
    return [f.result() for f in [tier.get(k, pool.try_alloc) for k in keys]]


def _check_and_free(pool: HostPool, got: list[torch.Tensor | None], objs: list[torch.Tensor]) -> None:
    for g, o in zip(got, objs, strict=True):
        if g is None or not torch.equal(g.view(torch.uint8), o.view(torch.uint8)):
            raise AssertionError("a tier returned wrong bytes")
        pool.free(g)


def _plain_write(directory: Path, objs: list[torch.Tensor], direct: bool, threads: int) -> None:
    def one(i: int) -> None:
        fd = os.open(directory / f"plain-{i}", os.O_CREAT | os.O_WRONLY | os.O_TRUNC | (_O_DIRECT if direct else 0))
        try:
            os.write(fd, _bytes(objs[i]))
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(objs))))


def _plain_read(directory: Path, dests: list[torch.Tensor], direct: bool, threads: int) -> None:
    def one(i: int) -> None:
        fd = os.open(directory / f"plain-{i}", os.O_RDONLY | (_O_DIRECT if direct else 0))
        try:
            os.readv(fd, [_bytes(dests[i])])
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(dests))))


def bench_disk(root: Path, pool: HostPool, name: str, objs: list[torch.Tensor], reps: int) -> list[dict]:
    rows = []
    nbytes = sum(o.nbytes for o in objs)
    root.mkdir(parents=True, exist_ok=True)
    for direct in [True, False] if supports_direct(str(root)) else [False]:
        times: dict[str, list[float]] = {}
        for rep in range(reps):
            shutil.rmtree(root / "tier", ignore_errors=True)
            tier = DiskTier(root / "tier", 4 * nbytes, workers=THREADS, direct=direct, name=f"bench-{rep}-{direct}")
            keys = [f"{name}/{rep}/{i}".encode() for i in range(len(objs))]
            times.setdefault("tier_write", []).append(_timed(_put_all, tier, keys, objs)[0])
            for threads in (1, THREADS):
                plain_dir = root / f"plain{threads}"
                shutil.rmtree(plain_dir, ignore_errors=True)
                plain_dir.mkdir(parents=True)
                seconds, _ = _timed(_plain_write, plain_dir, objs, direct, threads)
                times.setdefault(f"plain{threads}_write", []).append(seconds)
            seconds, got = _timed(_get_all, tier, keys, pool)
            times.setdefault("tier_read", []).append(seconds)
            _check_and_free(pool, got, objs)
            dests = [pool.alloc(o.shape, o.dtype) for o in objs]
            for threads in (1, THREADS):
                seconds, _ = _timed(_plain_read, root / f"plain{threads}", dests, direct, threads)
                times.setdefault(f"plain{threads}_read", []).append(seconds)
            for d in dests:
                pool.free(d)
            tier.close()
        for op in ("write", "read"):
            rows.append(_row(f"disk ({'O_DIRECT' if direct else 'buffered'})", name, objs, op, times, nbytes))
    return rows


def bench_checksum(objs: list[torch.Tensor], reps: int) -> float:
    """xxh3-128 over the same bytes on one thread: the pass a tier adds to every put and get."""
    nbytes = sum(o.nbytes for o in objs)
    seconds = [_timed(lambda: [xxhash.xxh3_128(_bytes(o)).digest() for o in objs])[0] for _ in range(reps)]
    return nbytes / statistics.median(seconds) / 1e9


def _raw_set_all(raw: redis.Redis, keys: list[bytes], objs: list[torch.Tensor]) -> None:
    for k, o in zip(keys, objs, strict=True):
        raw.set(k, _bytes(o))


def _raw_get_all(raw: redis.Redis, keys: list[bytes]) -> list[bytes]:
    return [raw.get(k) for k in keys]


def bench_redis(url: str, pool: HostPool, name: str, objs: list[torch.Tensor], reps: int) -> list[dict]:
    raw = redis.Redis.from_url(url)
    nbytes = sum(o.nbytes for o in objs)
    times: dict[str, list[float]] = {}
    tier = make_tier(f"{url}?workers=2&timeout=30s")
    for rep in range(reps):
        raw.flushall()
        keys = [f"{name}/{rep}/{i}".encode() for i in range(len(objs))]
        times.setdefault("tier_write", []).append(_timed(_put_all, tier, keys, objs)[0])
        seconds, got = _timed(_get_all, tier, keys, pool)
        times.setdefault("tier_read", []).append(seconds)
        _check_and_free(pool, got, objs)
        raw_keys = [b"raw/" + k for k in keys]
        times.setdefault("plain1_write", []).append(_timed(_raw_set_all, raw, raw_keys, objs)[0])
        times.setdefault("plain1_read", []).append(_timed(_raw_get_all, raw, raw_keys)[0])
    tier.close()
    raw.flushall()
    return [_row("redis", name, objs, op, times, nbytes) for op in ("write", "read")]


def _row(tier: str, name: str, objs: list[torch.Tensor], op: str, times: dict, nbytes: int) -> dict:
    def gbps(label: str) -> float | None:
        samples = times.get(f"{label}_{op}")
        return nbytes / statistics.median(samples) / 1e9 if samples else None

    plain = [v for v in (gbps("plain1"), gbps(f"plain{THREADS}")) if v is not None]
    return {
        "tier": tier,
        "object": name,
        "object_bytes": objs[0].nbytes,
        "count": len(objs),
        "op": op,
        "tier_GBps": gbps("tier"),
        "plain_1_thread_GBps": gbps("plain1"),
        f"plain_{THREADS}_threads_GBps": gbps(f"plain{THREADS}"),
        "ratio": gbps("tier") / max(plain),
    }


def _start_redis(workdir: Path) -> tuple[subprocess.Popen | None, str | None]:
    server = shutil.which("redis-server")
    if server is None:
        return None, None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    process = subprocess.Popen([*args, "--dir", str(workdir)], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}"
    for _ in range(200):
        try:
            redis.Redis.from_url(url).ping()
            return process, url
        except redis.ConnectionError:
            time.sleep(0.02)
    process.kill()
    raise RuntimeError("redis-server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="directory on the filesystem to test (a temp dir)")
    parser.add_argument("--total-mib", type=int, default=256, help="bytes per pass, per object shape")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--out", type=Path, default=Path("bench-out/bench_tiers.json"))
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="kvferry-bench-", dir=args.dir))
    process, url = (None, args.redis_url) if args.redis_url else _start_redis(root)
    pool = HostPool(-(-3 * args.total_mib * MIB // 4096) * 4096 + 64 * MIB, pin=False)
    rows: list[dict] = []
    checksum_gbps: dict[str, float] = {}
    try:
        for name, shape in OBJECTS.items():
            one = torch.Size(shape).numel() * 2
            count = max(2, args.total_mib * MIB // one)
            gen = torch.Generator().manual_seed(0)
            objs = [pool.alloc(shape, torch.bfloat16) for _ in range(count)]
            for obj in objs:  # random bits, never zeros
                obj.view(torch.uint8).view(-1).copy_(torch.randint(0, 256, (one,), dtype=torch.uint8, generator=gen))
            checksum_gbps[name] = bench_checksum(objs, args.reps)
            rows += bench_disk(root, pool, name, objs, args.reps)
            if url:
                rows += bench_redis(url, pool, name, objs, args.reps)
            for obj in objs:
                pool.free(obj)
    finally:
        if process is not None:
            process.kill()
        shutil.rmtree(root, ignore_errors=True)

    result = {
        "benchmark": "bench_tiers",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "redis_py": redis.__version__,
        "cpus": os.cpu_count(),
        "checksum_xxh3_1_thread_GBps": checksum_gbps,
        "directory": str(args.dir or tempfile.gettempdir()),
        "redis": url if args.redis_url else ("local redis-server" if url else None),
        "reps": args.reps,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))

    table = Table(title=f"kvferry tiers vs plain I/O of the same bytes (median of {args.reps})")
    for column in ("tier", "object", "op", "tier GB/s", "plain 1 thr", f"plain {THREADS} thr", "ratio"):
        table.add_column(column, justify="left" if column in ("tier", "object", "op") else "right")
    for row in rows:
        plain_n = row[f"plain_{THREADS}_threads_GBps"]
        table.add_row(
            row["tier"],
            f"{row['object']} ({row['object_bytes'] // MIB} MiB x {row['count']})",
            row["op"],
            f"{row['tier_GBps']:.2f}",
            f"{row['plain_1_thread_GBps']:.2f}",
            "-" if plain_n is None else f"{plain_n:.2f}",
            f"{row['ratio']:.2f}",
        )
    console = Console(width=130)
    console.print(table)
    rates = ", ".join(f"{k} {v:.2f} GB/s" for k, v in checksum_gbps.items())
    console.print(f"checksum (xxh3-128), 1 thread, same bytes: {rates}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

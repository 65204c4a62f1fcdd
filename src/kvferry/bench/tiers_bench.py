"""`kvferry bench tiers`: tier throughput against the same bytes moved plainly, in the same run, on the same
filesystem / server.

Objects are chunk-shaped bf16 tensors in host pool memory: llama3-8b ([2, 32, 256, 1024], 32 MiB) and
qwen2.5-0.5b ([2, 24, 256, 128], 3 MiB), or with --codec fp8 their fp8 objects (16.5 and 1.6 MiB of bytes);
each pass moves about --total-mib of them (at least two objects).
Disk, per mode (O_DIRECT and buffered): the tier's put / get (workers=4, header + checksum + temp file +
rename; get verifies) against plain `os.write` / `os.readv` of the same bytes to files in the same directory,
with O_DIRECT exactly when the tier uses it, run both one file at a time and on 4 threads; the ratio is
against the faster of the two. Redis: the tier's put / get (pipelined, verified, copied into the pool)
against raw redis-py SET / GET of the same bytes, one at a time with a default client. Without --redis-url a
redis-server is started on a free loopback port (and skipped if there is none). Mooncake (with --mooncake URL):
the tier's put / get against a raw client's batch_put_from / batch_get_into of the same pool bytes
(bench/tiers_mooncake.py). Numbers are medians of --reps.
The checksum (xxh3-128) over the same bytes on one thread is reported too: the pass every tier put and get adds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import redis
import torch
import xxhash

from kvferry.bench.harness import BenchError, Outcome, Steps, add_json_argument, description_of, positive
from kvferry.bench.report import new_table
from kvferry.bench.tiers_mooncake import bench_mooncake, check_url
from kvferry.formats import CODECS, Codec
from kvferry.formats.codec import codec_group
from kvferry.formats.synthetic import MODELS
from kvferry.memory import HostPool
from kvferry.tiers import DiskTier, Tier, make_tier, parse_tier_url
from kvferry.tiers.direct_io import supports_direct

MIB = 1 << 20
OBJECTS = {"llama3-8b": (2, 32, 256, 1024), "qwen2.5-0.5b": (2, 24, 256, 128)}
THREADS = 4
_O_DIRECT = getattr(os, "O_DIRECT", 0)

DESCRIPTION = description_of(__doc__)
EXAMPLES = """\
examples:
  kvferry bench tiers                                     # a temporary directory, a local redis-server
  kvferry bench tiers --dir /var/tmp --total-mib 512 --reps 5
  kvferry bench tiers --redis-url redis://127.0.0.1:6379 --objects qwen2.5-0.5b --json bench-out/tiers.json
  kvferry bench tiers --objects llama3-8b --mooncake 'mooncake://10.0.0.1:50051?metadata=http://10.0.0.1:8080/metadata'
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dir", type=Path, default=None, help="directory on the filesystem to test (default: the temp dir)"
    )
    parser.add_argument(
        "--total-mib", type=int, default=256, help="bytes per pass, per object shape (default: %(default)s)"
    )
    parser.add_argument("--reps", type=int, default=3, help="passes per case; medians (default: %(default)s)")
    parser.add_argument(
        "--redis-url", default=None, help="a Redis to test (default: start a redis-server on loopback if there is one)"
    )
    parser.add_argument(
        "--mooncake", metavar="URL", default=None, help="a mooncake:// tier URL to test against the raw client (off)"
    )
    parser.add_argument(
        "--objects",
        default=",".join(OBJECTS),
        help=f"object shapes, comma-separated, of: {', '.join(OBJECTS)} (default: both)",
    )
    parser.add_argument(
        "--codec", choices=CODECS, default="none", help="the objects' codec (fp8: half the bytes; default: none)"
    )
    add_json_argument(parser)


def _objects(args: argparse.Namespace) -> dict[str, tuple[int, ...]]:
    names = [n.strip() for n in args.objects.split(",") if n.strip()]
    unknown = [n for n in names if n not in OBJECTS]
    if unknown or not names:
        raise BenchError(f"--objects {args.objects!r}: each must be one of {', '.join(OBJECTS)}")
    shapes: dict[str, tuple[int, ...]] = {n: OBJECTS[n] for n in dict.fromkeys(names)}
    if getattr(args, "codec", "none") == "fp8":  # bytes: each row's values, then a float32 scale per head
        shapes = {n: (*s[:3], Codec("fp8", s[3], codec_group(MODELS[n].hs)).row_bytes) for n, s in shapes.items()}
    return shapes


def check(args: argparse.Namespace) -> None:
    positive(args, "total_mib", "reps")
    _objects(args)
    if args.dir is not None and not args.dir.is_dir():
        raise BenchError(f"--dir {args.dir} is not a directory")
    if args.redis_url:
        try:
            redis.Redis.from_url(args.redis_url, socket_timeout=5).ping()
        except (redis.RedisError, ValueError) as exc:
            raise BenchError(f"--redis-url {args.redis_url}: {exc}") from None
    if args.mooncake:
        check_url(args.mooncake)


def run(args: argparse.Namespace, steps: Steps) -> Outcome:
    objects = _objects(args)
    dtype = torch.uint8 if args.codec == "fp8" else torch.bfloat16
    counts = {name: max(2, args.total_mib * MIB // _nbytes(shape, dtype)) for name, shape in objects.items()}
    root = Path(tempfile.mkdtemp(prefix="kvferry-bench-", dir=args.dir))
    process, url = (None, args.redis_url) if args.redis_url else _start_redis(root)
    modes = [True, False] if supports_direct(str(root)) else [False]
    steps.expect(len(objects) * (1 + args.reps * (len(modes) + (1 if url else 0) + (1 if args.mooncake else 0))))
    # Room for one pass's objects, what a get brings back, and a plain read's destinations.
    largest = max(counts[name] * _nbytes(shape, dtype) for name, shape in objects.items())
    pool = HostPool(-(-3 * largest // 4096) * 4096 + 64 * MIB, pin=False)
    rows: list[dict[str, Any]] = []
    checksum_gbps: dict[str, float] = {}
    try:
        for name, shape in objects.items():
            one = _nbytes(shape, dtype)
            gen = torch.Generator().manual_seed(0)
            objs = [pool.alloc(shape, dtype) for _ in range(counts[name])]
            for obj in objs:  # random bits, never zeros
                obj.view(torch.uint8).view(-1).copy_(torch.randint(0, 256, (one,), dtype=torch.uint8, generator=gen))
            checksum_gbps[name] = bench_checksum(objs, args.reps)
            steps.done(f"{name}: checksum")
            rows += bench_disk(root, pool, name, objs, args.reps, modes, steps)
            if url:
                rows += bench_redis(url, pool, name, objs, args.reps, steps)
            if args.mooncake:
                times = bench_mooncake(args.mooncake, pool, name, objs, args.reps, steps)
                nbytes = sum(o.nbytes for o in objs)
                rows += [_row("mooncake", name, objs, op, times, nbytes) for op in ("write", "read")]
            for obj in objs:
                pool.free(obj)
    finally:
        if process is not None:
            process.kill()
            process.wait()
        shutil.rmtree(root, ignore_errors=True)
    config = {
        "directory": str(args.dir or tempfile.gettempdir()),
        "total_mib": args.total_mib,
        "objects": {name: list(shape) for name, shape in objects.items()},
        "redis": url if args.redis_url else ("local redis-server" if url else None),
        "redis_py": redis.__version__,
        "mooncake": parse_tier_url(args.mooncake).shown if args.mooncake else None,
        "reps": args.reps,
        "codec": args.codec,
    }
    results = {"checksum_xxh3_1_thread_GBps": checksum_gbps, "rows": rows}
    return Outcome(config, results, _show(rows, checksum_gbps, args.reps))


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def _show(rows: list[dict[str, Any]], checksum_gbps: dict[str, float], reps: int) -> list[Any]:
    threads = THREADS
    table = new_table(
        f"kvferry tiers vs plain I/O of the same bytes (median of {reps})",
        ("tier", "object", "op", "tier GB/s", "chunks/s", "plain 1 thr", f"plain {threads} thr", "ratio"),
        names=3,
    )
    for row in rows:
        plain_n = row[f"plain_{threads}_threads_GBps"]
        table.add_row(
            row["tier"],
            f"{row['object']} ({row['object_bytes'] / MIB:.1f} MiB x {row['count']})",
            row["op"],
            f"{row['tier_GBps']:.2f}",
            f"{row['tier_GBps'] * 1e9 / row['object_bytes']:.0f}",
            f"{row['plain_1_thread_GBps']:.2f}",
            "-" if plain_n is None else f"{plain_n:.2f}",
            f"{row['ratio']:.2f}",
        )
    rates = ", ".join(f"{k} {v:.2f} GB/s" for k, v in checksum_gbps.items())
    return [table, f"checksum (xxh3-128), 1 thread, same bytes: {rates}"]


def _start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes] | None, str | None]:
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
    process.wait()
    raise BenchError("redis-server did not start")


def _bytes(t: torch.Tensor) -> memoryview:
    return t.reshape(-1).view(torch.uint8).numpy().data


def _timed(fn: Callable[..., object], *args: object) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


def _put_all(tier: Tier, keys: list[bytes], objs: list[torch.Tensor]) -> list[bool]:
    return [f.result() for f in [tier.put(k, o) for k, o in zip(keys, objs, strict=True)]]


def _get_all(tier: Tier, keys: list[bytes], pool: HostPool) -> list[torch.Tensor | None]:
    return [f.result() for f in [tier.get(k, pool.try_alloc) for k in keys]]


def _check_and_free(pool: HostPool, got: Any, objs: list[torch.Tensor]) -> None:
    for g, o in zip(got, objs, strict=True):
        if g is None or not torch.equal(g.view(torch.uint8), o.view(torch.uint8)):
            raise BenchError("a tier returned wrong bytes")
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


def bench_disk(
    root: Path, pool: HostPool, name: str, objs: list[torch.Tensor], reps: int, modes: list[bool], steps: Steps
) -> list[dict[str, Any]]:
    rows = []
    nbytes = sum(o.nbytes for o in objs)
    for direct in modes:
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
            steps.done(f"{name}: disk ({'O_DIRECT' if direct else 'buffered'}) pass {rep + 1}/{reps}")
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


def _raw_get_all(raw: redis.Redis, keys: list[bytes]) -> list[Any]:
    return [raw.get(k) for k in keys]


def bench_redis(
    url: str, pool: HostPool, name: str, objs: list[torch.Tensor], reps: int, steps: Steps
) -> list[dict[str, Any]]:
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
        steps.done(f"{name}: redis pass {rep + 1}/{reps}")
    tier.close()
    raw.flushall()
    return [_row("redis", name, objs, op, times, nbytes) for op in ("write", "read")]


def _row(tier: str, name: str, objs: list[torch.Tensor], op: str, times: dict, nbytes: int) -> dict[str, Any]:
    def gbps(label: str) -> float | None:
        samples = times.get(f"{label}_{op}")
        return nbytes / statistics.median(samples) / 1e9 if samples else None

    plain = [v for v in (gbps("plain1"), gbps(f"plain{THREADS}")) if v is not None]
    tier_gbps = gbps("tier")
    assert tier_gbps is not None  # every pass times the tier
    return {
        "tier": tier,
        "object": name,
        "object_bytes": objs[0].nbytes,
        "count": len(objs),
        "op": op,
        "tier_GBps": tier_gbps,
        "plain_1_thread_GBps": gbps("plain1"),
        f"plain_{THREADS}_threads_GBps": gbps(f"plain{THREADS}"),
        "ratio": tier_gbps / max(plain),
    }

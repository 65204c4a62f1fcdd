"""Soak: a `kvferry server` over a disk and a Redis tier under mixed traffic for a fixed time, clients joining,
leaving and dying by SIGKILL, Redis restarted once halfway. Every hit is checked byte for byte; at the end every
prompt ever stored comes back whole and right (the disk tier holds them all), and the server's RSS, descriptors,
threads, sessions, registrations and locks are back to what they were after warming up; each op's p99 in the
last time bucket is in line with the run's.

The short variant runs in CI; the long one only when asked for: `KVFERRY_SOAK_S=1800 pytest -m soak
tests/server/test_soak.py -s` (KVFERRY_SOAK_REPORT=PATH writes its figures as JSON).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import pytest

from kvferry.client import KvferryClient
from tests.server.serverkit import FMT_REAL, REAL_BS, REAL_CHUNK, REAL_NS, ServerProcess, wait_for
from tests.server.soakkit import (
    DST,
    PROMPT_TOKENS,
    SRC,
    footprint,
    new_kv,
    p99,
    prompt_tokens,
    soak_client,
    write_prompt,
    wrong_blocks,
)
from tests.tiers.tierkit import NO_REDIS_REASON, REDIS_CLI, REDIS_SERVER, RedisServer

pytestmark = pytest.mark.skipif(not (REDIS_SERVER and REDIS_CLI), reason=NO_REDIS_REASON)

SOAK_S = float(os.environ.get("KVFERRY_SOAK_S", "1800"))
WORKERS = 2  # transfer and tier workers each
# Threads the server starts on demand: transfer and tier workers, copy threads (one per CPU), the cache's async
# workers (2) and the disk tier's writers and readers (4 each).
LAZY_THREADS = 2 * WORKERS + len(os.sched_getaffinity(0)) + 2 + 8
REDIS_USERS = WORKERS + 2 + 1  # the tier workers, the Redis tier's batching threads and the tier watch
# forkserver: clients start from a process that imported torch and kvferry once (a spawn would import per client)
CLIENTS = multiprocessing.get_context("forkserver")
CLIENTS.set_forkserver_preload(["tests.server.soakkit", "kvferry.client"])


def run_soak(workdir: Path, duration_s: float, bucket_s: float, clients: int, lifetime_s: tuple[float, float]) -> Any:
    redis = RedisServer(workdir).start()
    config = workdir / "kvferry.yaml"
    config.write_text("cache:\n  tier_write: on_store\n")  # every store reaches both tiers
    server = ServerProcess(
        "--config", str(config), "--chunk-size", str(REAL_CHUNK), "--l1-size-gb", "0.004",
        "--transfer-workers", str(WORKERS), "--tier-workers", str(WORKERS), "--heartbeat-interval", "0.5",
        "--heartbeat-timeout", "5", "--tier-check-interval", "0.5", "--l2", f"disk:{workdir / 'disk'}?size=128MB",
        "--l2", f"{redis.url}?timeout=2s&backoff=1s&backoff_max=2s",
    )  # fmt: skip
    try:
        # Warm-up: the pool filled, then traffic for the threads the server's pools (transfers, tiers, copies, disk
        # reads and writes) start on demand, and Redis connections; after it the footprint is the baseline.
        _audit(server.endpoint, range(24))
        _traffic(server, None, workdir / "warm-up", min(10.0, duration_s / 3), bucket_s, clients, lifetime_s)
        wait_for(lambda: _footprint(server)["sessions"] == 0, "the warm-up sessions to end", 30)
        baseline = _footprint(server)
        logs, killed = _traffic(server, redis, workdir, duration_s, bucket_s, clients, lifetime_s)
        report = {**_collect(logs, bucket_s), "clients": {"started": len(logs), "killed": killed}}
        stored = sorted(set().union(*(set(doc["stored"]) for doc in _read(logs))))
        report.update(audit=_audit(server.endpoint, stored), stored=len(stored))
        wait_for(lambda: _footprint(server)["sessions"] == 0, "every session to end", 30)
        report.update(baseline=baseline, end=_footprint(server), duration_s=duration_s)
        assert server.stop() == 0
        return report
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
        redis.kill()


def _footprint(server: ServerProcess) -> dict[str, Any]:
    return footprint(server.pid, server.http_port)


def _traffic(
    server: ServerProcess,
    redis: RedisServer | None,
    workdir: Path,
    duration_s: float,
    bucket_s: float,
    clients: int,
    lifetime_s: tuple[float, float],
) -> tuple[list[Path], int]:
    """Keep `clients` client processes running; each lives a random time, then leaves or is killed (SIGKILL).
    `redis` (when given) is killed and started again halfway. Their logs, and how many were killed."""
    workdir.mkdir(exist_ok=True)
    rng = random.Random(1)
    start = time.time()
    end = start + duration_s
    live: list[tuple[Any, float | None]] = []  # (process, when to kill it or None: it leaves by itself)
    logs: list[Path] = []
    restarted = redis is None
    killed: set[int] = set()
    while time.time() < end:
        live = [(proc, kill_at) for proc, kill_at in live if proc.is_alive()]
        for proc, kill_at in live:
            if kill_at is not None and time.time() >= kill_at:
                os.kill(proc.pid, signal.SIGKILL)
                killed.add(proc.pid)
        while len(live) < clients:
            leave = min(time.time() + rng.uniform(*lifetime_s), end)
            log = workdir / f"client-{len(logs)}.json"
            logs.append(log)
            args = (server.endpoint, len(logs), str(log), start, bucket_s, leave if rng.random() < 0.5 else end)
            proc = CLIENTS.Process(target=soak_client, args=args)
            proc.start()
            live.append((proc, None if args[-1] == leave else leave))
        if not restarted and time.time() >= start + duration_s / 2:
            assert redis is not None
            redis.kill()  # a crash: what it held is gone, the disk tier still has it
            redis.start()
            restarted = True
        time.sleep(0.2)
    for proc, _ in live:
        proc.join(timeout=30)
        assert proc.exitcode is not None, "a client did not stop"
    return logs, len(killed)


def _read(logs: list[Path]) -> list[dict[str, Any]]:
    return [json.loads(log.read_text()) for log in logs if log.exists()]


def _collect(logs: list[Path], bucket_s: float) -> dict[str, Any]:
    counts: dict[str, int] = {}
    latencies: dict[str, list[float]] = {}
    for doc in _read(logs):
        for name, n in doc["counts"].items():
            counts[name] = counts.get(name, 0) + n
        for key, samples in doc["latencies"].items():
            latencies.setdefault(key, []).extend(samples)
    p99_ms: dict[str, dict[int, float]] = {}
    for key, samples in latencies.items():
        op, bucket = key.split("/")
        if len(samples) >= 20:  # a bucket's p99 of fewer samples says little
            p99_ms.setdefault(op, {})[int(bucket)] = round(1e3 * p99(samples), 2)
    return {"counts": counts, "p99_ms": p99_ms, "bucket_s": bucket_s}


def _audit(endpoint: str, prompts: Any) -> dict[str, int]:
    """Read each of `prompts` back whole (once any promotion from a tier has landed), checking every byte; one not
    all there is counted missing, and stored (the warm-up stores them all so)."""
    counts = {"chunks_checked": 0, "wrong_blocks": 0, "missing": 0}
    kv = new_kv()
    with KvferryClient(endpoint, timeout_s=30) as client:
        reg = client.register_kv_cache(kv, FMT_REAL, namespace=REAL_NS)
        for prompt in prompts:
            tokens = prompt_tokens(prompt)
            wait_for(lambda t=tokens: client.lookup(t, registration=reg).pending == 0, "a promotion", 30)
            if client.lookup(tokens, registration=reg).tokens < PROMPT_TOKENS:
                counts["missing"] += 1
                write_prompt(kv, prompt)
                assert client.store(reg, tokens, SRC) == PROMPT_TOKENS
            got = client.retrieve(reg, tokens, DST)
            counts["chunks_checked"] += got // REAL_CHUNK
            counts["wrong_blocks"] += wrong_blocks(kv, prompt, got // REAL_BS)
    return counts


def check(report: dict[str, Any]) -> None:
    print(json.dumps(report, indent=1))
    counts, base, end = report["counts"], report["baseline"], report["end"]
    assert counts.get("requests", 0) > 0 and counts.get("chunks_checked", 0) > 0
    # Nothing a client was told is stored went missing (the disk tier holds every prompt), and all of it is right.
    audit = report["audit"]
    assert audit["missing"] == 0 and audit["chunks_checked"] == PROMPT_TOKENS // REAL_CHUNK * report["stored"]
    assert counts.get("wrong_blocks", 0) == 0 and audit["wrong_blocks"] == 0
    assert end["sessions"] == end["registrations"] == end["locks"] == 0
    # The server's pools start their threads on demand (LAZY_THREADS in all), and a thread that uses Redis holds a
    # connection: a thread or a descriptor per session (hundreds of sessions in the long run) would show.
    assert end["threads"] <= base["threads"] + LAZY_THREADS and end["fds"] <= base["fds"] + REDIS_USERS
    assert end["rss_mib"] <= base["rss_mib"] + 48  # the pool is warm: what is left would be a leak
    for op, by_bucket in report["p99_ms"].items():
        if len(by_bucket) >= 3:
            last = by_bucket[max(by_bucket)]
            assert last <= 3 * statistics.median(by_bucket.values()) + 20, f"{op}'s p99 grew: {by_bucket}"


def test_a_short_soak_leaves_the_server_as_it_found_it(tmp_path: Path) -> None:
    check(run_soak(tmp_path, 15, 5, clients=3, lifetime_s=(3, 8)))


@pytest.mark.soak
@pytest.mark.timeout(SOAK_S + 600)
def test_a_long_soak_leaves_the_server_as_it_found_it(tmp_path: Path) -> None:
    report = run_soak(tmp_path, SOAK_S, 60, clients=4, lifetime_s=(20, 120))
    if os.environ.get("KVFERRY_SOAK_REPORT"):
        Path(os.environ["KVFERRY_SOAK_REPORT"]).write_text(json.dumps(report, indent=1))
    check(report)

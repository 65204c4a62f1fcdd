"""Chaos: client processes store, look up and retrieve overlapping prompts while clients are killed and frozen
at random and the Redis tier is killed, frozen and restarted. Afterwards every byte reported as a hit has been
checked, the pool and its locks are back where they started, no session is left, and no request of a client
that was running waited longer than its timeout. Bounded: about a minute, loopback only."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvferry.client import KvferryClient
from tests.server.chaoskit import CHUNK, TIMEOUT_S, chaos_client
from tests.server.serverkit import ServerProcess, freeze, wait_for
from tests.tiers.tierkit import NO_REDIS_REASON, REDIS_CLI, REDIS_SERVER, RedisServer

SPAWN = multiprocessing.get_context("spawn")
CLIENTS = 4
CHAOS_S = 30.0
OBJECT_BYTES = 2 * 4 * CHUNK * 64 * 2  # [2, NL=4, chunk, NH*HS=64] bf16
SLACK_S = 1.0  # a 2-core machine running four clients, a server and Redis schedules late now and then

pytestmark = pytest.mark.skipif(not (REDIS_SERVER and REDIS_CLI), reason=NO_REDIS_REASON)


class _Clients:
    """The client processes, by slot; a killed one is replaced at once (with a new seed)."""

    def __init__(self, endpoint: str, workdir: Path) -> None:
        self.endpoint = endpoint
        self.workdir = workdir
        self.stop = SPAWN.Event()
        self.procs: dict[int, Any] = {}
        self.reports: dict[int, Path] = {}  # pid -> where it reports
        self.frozen: dict[int, list[tuple[float, float]]] = {}  # pid -> (from, to) wall-clock intervals
        self.seeds = iter(range(1000, 100_000))

    def spawn(self, slot: int) -> None:
        seed = next(self.seeds)
        path = self.workdir / f"client-{seed}.json"
        proc = SPAWN.Process(target=chaos_client, args=(self.endpoint, seed, self.stop, str(path)), daemon=True)
        proc.start()
        self.procs[slot] = proc
        self.reports[proc.pid] = path

    def kill(self, slot: int) -> None:
        proc = self.procs[slot]
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        self.reports.pop(proc.pid)  # it never reports: it is not a live client
        self.spawn(slot)


def _get(server: ServerProcess, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}{path}", timeout=10) as response:
        body = response.read()
    return body.decode() if path == "/metrics" else json.loads(body)


def test_chaos(tmp_path: Path) -> None:
    started = time.monotonic()
    redis = RedisServer(tmp_path).start()
    server = ServerProcess(
        "--chunk-size", str(CHUNK), "--l1-size-gb", "0.001", "--heartbeat-interval", "0.3",
        "--heartbeat-timeout", "2", "--tier-check-interval", "0.5", "--transfer-workers", "2",
        "--l2", f"{redis.url}?timeout=500ms&backoff=200ms&backoff_max=1s",
    )  # fmt: skip
    clients = _Clients(server.endpoint, tmp_path)
    rng = random.Random(17)
    thaw_at: dict[int, float] = {}  # pid -> when it is let go
    redis_back_at: float | None = None  # when Redis is restarted (killed) or let go (frozen)
    redis_frozen = False
    actions: dict[str, int] = {}
    try:
        for slot in range(CLIENTS):
            clients.spawn(slot)
        wait_for(lambda: len(_get(server, "/stats")["sessions"]) == CLIENTS, "every client to register", 60)
        chaos_end = time.monotonic() + CHAOS_S
        next_action = time.monotonic() + 1.0
        while time.monotonic() < chaos_end:
            now = time.monotonic()
            for pid, until in list(thaw_at.items()):
                if now >= until:
                    os.kill(pid, signal.SIGCONT)
                    clients.frozen[pid][-1] = (clients.frozen[pid][-1][0], time.time())
                    del thaw_at[pid]
            if redis_back_at is not None and now >= redis_back_at:
                if redis_frozen:
                    redis.process.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
                else:
                    redis.start()
                redis_back_at, redis_frozen = None, False
            if now >= next_action:
                next_action = now + rng.uniform(0.8, 2.0)
                action = rng.choice(["kill_client", "freeze_client", "freeze_client", "kill_redis", "freeze_redis"])
                slot = rng.randrange(CLIENTS)
                pid = clients.procs[slot].pid
                if action == "kill_client" and pid not in thaw_at:
                    clients.kill(slot)
                elif action == "freeze_client" and pid not in thaw_at:
                    freeze(pid)
                    clients.frozen.setdefault(pid, []).append((time.time(), float("inf")))
                    thaw_at[pid] = now + rng.uniform(0.5, 3.5)  # past the 2 s heartbeat timeout, or not
                elif action in ("kill_redis", "freeze_redis") and redis_back_at is None:
                    if action == "kill_redis":
                        redis.kill()
                    else:
                        freeze(redis.process.pid)  # type: ignore[union-attr]
                        redis_frozen = True
                    redis_back_at = now + rng.uniform(0.5, 2.0)
                else:
                    continue
                actions[action] = actions.get(action, 0) + 1
            time.sleep(0.02)
        # Let everything go, then stop the clients: each ends its session and reports.
        for pid in thaw_at:
            os.kill(pid, signal.SIGCONT)
            clients.frozen[pid][-1] = (clients.frozen[pid][-1][0], time.time())
        if redis_back_at is not None and redis_frozen:
            redis.process.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
        elif redis_back_at is not None:
            redis.start()
        clients.stop.set()
        for proc in clients.procs.values():
            proc.join(30)
            assert proc.exitcode == 0, f"client {proc.pid} exited with {proc.exitcode}"

        reports = {pid: json.loads(path.read_text()) for pid, path in clients.reports.items()}
        assert len(reports) >= CLIENTS and {"kill_client", "freeze_client"} <= set(actions), actions
        assert {"kill_redis", "freeze_redis"} & set(actions), actions
        for pid, report in reports.items():
            assert report["corrupt"] == 0 and report["lock_short"] == 0, report
            assert report["unexpected"] == [], report["unexpected"]
            for op, began, ended in report["slow"]:  # no live client's request outlasted its timeout
                frozen_meanwhile = any(f < ended and began < t for f, t in clients.frozen.get(pid, []))
                assert frozen_meanwhile or ended - began <= TIMEOUT_S + SLACK_S, (op, ended - began, report)
        assert sum(r["verified_bytes"] for r in reports.values()) > 0
        assert sum(r["stored_tokens"] for r in reports.values()) > 0
        assert sum(sum(r["ops"].values()) for r in reports.values()) > 100

        # The server is back to where it started: no session, no lock, no registration, every pool byte held
        # by an indexed object; once cleared, an empty pool.
        with KvferryClient(server.endpoint, timeout_s=10) as checker:

            def settled() -> bool:
                stats = checker.stats()
                cache, sessions = stats["cache"], stats["server"]["sessions"]
                return (
                    [s["session"] for s in sessions] == [checker.session_id.hex()]
                    and stats["server"]["open_registrations"] == 0
                    and cache["locks"] == 0
                    and cache["pool"]["used_bytes"] == cache["objects"] * OBJECT_BYTES
                )

            wait_for(settled, "sessions, locks and registrations to be released", 20)
            checker.clear()
            wait_for(lambda: checker.stats()["cache"]["pool"]["used_bytes"] == 0, "the pool to empty")
            assert checker.stats()["cache"]["objects"] == 0
        wait_for(lambda: _get(server, "/health")["status"] == "ok", "/health to see Redis back", 15)
        assert 'status="INTERNAL"' not in _get(server, "/metrics")
    finally:
        clients.stop.set()
        for proc in clients.procs.values():
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
        if redis.process is not None:
            redis.process.send_signal(signal.SIGCONT)
        assert server.stop() == 0, "".join(server.log[-50:])
        redis.kill()
    assert time.monotonic() - started < 120, "the chaos test must stay under two minutes"

"""`kvferry server` in a subprocess with the real cache engine, and client processes sharing CPU KV."""

from __future__ import annotations

import json
import multiprocessing
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import torch

from kvferry.client import KvferryClient
from tests.server.serverkit import (
    FMT_REAL,
    REAL_BS,
    REAL_CHUNK,
    REAL_NS,
    ServerProcess,
    blocks,
    real_kv,
    shm_mappings,
    victim_process,
    wait_for,
    writer_process,
)

SPAWN = multiprocessing.get_context("spawn")  # a fresh interpreter per client, as engines are


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--chunk-size", str(REAL_CHUNK), "--l1-size-gb", "0.05", "--heartbeat-interval", "0.2",
        "--heartbeat-timeout", "3", "--max-message-mb", "0.0625", "--transfer-workers", "2",
    )  # fmt: skip
    yield proc
    assert proc.stop() == 0, "".join(proc.log)  # SIGTERM is a clean shutdown
    assert any("kvferry server stopped" in line for line in proc.log)


def cache_stats(client: KvferryClient) -> dict:
    return client.stats()["cache"]


def test_banner_logs_the_effective_config(server: ServerProcess) -> None:
    banner = next(line for line in server.log if "starting with config" in line)
    config = json.loads(banner.split("starting with config ", 1)[1])
    assert config["cache"]["chunk_size"] == REAL_CHUNK
    assert config["server"]["host"] == "127.0.0.1" and config["server"]["heartbeat_timeout_s"] == 3


def test_store_in_one_process_retrieve_in_another_bit_exact(server: ServerProcess) -> None:
    tokens = np.random.default_rng(7).integers(0, 120_000, size=3 * REAL_CHUNK + 10).tolist()
    source_ids = [int(b) for b in np.random.default_rng(8).permutation(48)[:13]]  # scattered blocks
    target_ids = list(range(50, 63))
    with ProcessPoolExecutor(1, mp_context=SPAWN) as writer:
        stored = writer.submit(writer_process, server.endpoint, tokens, source_ids).result(timeout=120)
    assert stored == 3 * REAL_CHUNK  # full chunks only; the 10-token tail is not cached
    # This test's process is the second client: its own KV, its own session.
    kv = real_kv(seed=2)
    first_chunk = blocks(kv, target_ids[: REAL_CHUNK // REAL_BS])
    with KvferryClient(server.endpoint) as reader:
        reg = reader.register_kv_cache(kv, FMT_REAL, namespace=REAL_NS)
        assert reader.lookup(tokens, registration=reg).tokens == 3 * REAL_CHUNK
        assert reader.retrieve(reg, tokens, target_ids, skip_prefix_tokens=REAL_CHUNK) == 2 * REAL_CHUNK
    written = slice(REAL_CHUNK // REAL_BS, 3 * REAL_CHUNK // REAL_BS)
    assert torch.equal(blocks(kv, target_ids[written]), blocks(real_kv(seed=1), source_ids[written]))
    assert torch.equal(blocks(kv, target_ids[: REAL_CHUNK // REAL_BS]), first_chunk)  # skipped prefix untouched


def test_sigkill_mid_request_frees_locks_registrations_and_memory(server: ServerProcess) -> None:
    kv = real_kv(seed=4)
    locked = list(range(1000, 1000 + 2 * REAL_CHUNK))
    big = list(range(5000, 5000 + 24 * REAL_CHUNK // 4))
    with KvferryClient(server.endpoint) as survivor:
        survivor.clear()
        reg = survivor.register_kv_cache(kv, FMT_REAL, namespace=REAL_NS)
        survivor.store(reg, locked, list(range(8)))
        baseline = cache_stats(survivor)
        assert baseline["locks"] == 0
        ready = SPAWN.Queue()
        victim = SPAWN.Process(target=victim_process, args=(server.endpoint, locked, big, ready))
        victim.start()
        shm_name = ready.get(timeout=60)
        victim.join(timeout=60)
        assert victim.exitcode == -9
        # Freed on disconnect: its lock, its registration and the server's mapping of its memory.
        wait_for(lambda: len(survivor.stats()["server"]["sessions"]) == 1, "the victim's session to end")
        wait_for(lambda: survivor.stats()["server"]["open_registrations"] == 1, "its registration to close")
        assert cache_stats(survivor)["locks"] == 0
        wait_for(lambda: shm_mappings(shm_name, server.pid) == 0, "the server to unmap its KV")
        assert not os.path.exists("/dev/shm" + shm_name)  # never a file: torch's fd strategy unlinks at once
        # The pool holds exactly the cached objects: nothing half-stored by the victim leaked.
        after = cache_stats(survivor)
        per_object = baseline["pool"]["used_bytes"] // baseline["objects"]
        assert after["pool"]["used_bytes"] == after["objects"] * per_object
        assert after["objects"] in (baseline["objects"] + 1, baseline["objects"] + len(big) // REAL_CHUNK)
        # The survivor keeps working, bit-exact.
        assert survivor.retrieve(reg, locked, list(range(40, 48))) == len(locked)
        assert torch.equal(blocks(kv, list(range(40, 48))), blocks(kv, list(range(8))))
        survivor.clear()
        assert cache_stats(survivor)["pool"]["used_bytes"] == 0


def test_random_and_malformed_frames_get_error_replies(server: ServerProcess) -> None:
    import msgpack
    import zmq

    from kvferry.protocol.messages import Op

    rng = np.random.default_rng(11)
    ops = [op.value for op in Op] + ["NOPE", "", 7]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(server.endpoint)

    def frames(i: int) -> list[bytes]:
        kind = i % 6
        if kind == 0:
            return [rng.bytes(int(rng.integers(0, 200)))]  # random bytes
        if kind == 1:  # a well-formed envelope with random arguments
            args = {str(rng.integers(5)): rng.bytes(3), "tokens": rng.bytes(int(rng.integers(0, 9)))}
            return [msgpack.packb({"v": 1, "id": i, "op": ops[i // 6 % len(ops)], "args": args})]  # every op, in turn
        if kind == 2:  # wrong version / id / shape of envelope
            return [msgpack.packb([{"v": 2, "id": i}, {"v": 1, "id": -1}, {"id": "x"}, 5][i % 4])]
        if kind == 3:
            return [b"a", b"b"]  # two frames
        if kind == 4:  # registration of memory that is not there
            kv = {"storage": 0, "offset": 0, "shape": [4], "stride": [1], "dtype": "bfloat16"}
            storage = {"kind": "shm_fd", "pid": 1, "fd": 100_000 + i, "offset_bytes": 64, "nbytes": 8}
            args = {"format": 1, "namespace": {"model": "m"}, "storages": [storage], "kv": kv}
            return [msgpack.packb({"v": 1, "id": i, "op": "REGISTER_KV_CACHE", "args": args})]
        return [b"\x00" * (64 * 1024 + 1)]  # over max_message_bytes (64 KiB)

    sent, batch = 3000, 250  # in batches: a peer that never reads would lose replies past ZMQ's high-water mark
    codes: dict[str, int] = {}
    for start in range(0, sent, batch):
        for i in range(start, start + batch):
            sock.send_multipart(frames(i))
        for _ in range(batch):
            assert sock.poll(30_000), f"only {sum(codes.values())} of {sent} frames were answered"
            reply = msgpack.unpackb(sock.recv())
            code = "ok" if reply["ok"] else reply["error"]["code"]
            codes[code] = codes.get(code, 0) + 1
    assert codes.get("ok", 0) < sent // 6  # only the valid envelopes of no-argument ops succeed
    assert {"MALFORMED", "TOO_LARGE", "BAD_ARGUMENT", "UNKNOWN_OP", "VERSION_MISMATCH"} <= set(codes)
    sock.close(linger=0)
    ctx.term()
    with KvferryClient(server.endpoint) as client:  # alive and serving
        assert client.get_chunk_size() == REAL_CHUNK


def test_http_side_port(server: ServerProcess) -> None:
    base = f"http://127.0.0.1:{server.http_port}"

    def get(path: str) -> tuple[str, bytes]:
        with urllib.request.urlopen(base + path, timeout=10) as response:
            return response.headers["Content-Type"], response.read()

    assert json.loads(get("/health")[1])["status"] == "ok"
    with KvferryClient(server.endpoint) as client:  # a PING of its own: the test may run first in its process
        client.ping()
    content_type, metrics = get("/metrics")
    assert content_type.startswith("text/plain")
    text = metrics.decode()
    assert 'kvferry_server_requests_total{op="PING",status="ok"}' in text
    assert "kvferry_cache_pool_used_bytes" in text and "kvferry_server_sessions" in text
    stats = json.loads(get("/stats")[1])
    assert stats["port"] == int(server.endpoint.rsplit(":", 1)[1]) and "sessions" in stats
    with pytest.raises(urllib.error.HTTPError) as missing:
        get("/nope")
    assert missing.value.code == 404

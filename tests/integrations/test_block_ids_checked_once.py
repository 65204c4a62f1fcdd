"""A request's block ids are checked once per process (`check_block_ids`), on the embedded and the server path."""

from __future__ import annotations

import random

import torch

from kvferry.cache import CacheEngine
from kvferry.client import KvferryClient
from kvferry.config import KvferryConfig, ServerConfig
from kvferry.connector.backends import EmbeddedBackend
from kvferry.integrations.vllm.kv_layout import recognise
from kvferry.memory import HostPool
from kvferry.server import KvferryServer
from tests.server.serverkit import FMT_REAL, PER_CHUNK, REAL_CHUNK, REAL_NS, blocks, real_kv

BS, CHUNK, NB = 32, 128, 24


def test_embedded_store_and_load_check_their_block_ids_once(block_id_checks: list[bool]) -> None:
    """A connector's store (full chunks and a tail) and load through a cache engine in this process: the engine
    checks the ids, the transfer takes them as checked."""
    buf = torch.randn(3, NB, 2, BS, 128).to(torch.bfloat16)  # 3 layers of [NB, NH=2, BS, 2*HS=128], one buffer
    kv = recognise({f"model.layers.{i}.attn": buf[i] for i in range(3)}, isa="vec", kv_cache_dtype="auto")
    config = KvferryConfig.load(env={}, overrides={"cache": {"chunk_size": CHUNK, "l1_size_gb": 0.01}})
    engine = CacheEngine(config)
    backend = EmbeddedBackend(engine, kv, engine.namespace_for("tiny", kv.fmt, kv.layers, block_size=kv.block_size))
    try:
        rng = random.Random(4)
        tokens = [rng.randrange(32_000) for _ in range(2 * CHUNK + BS + 5)]  # 2 chunks, a one-block tail, 5 more
        src, dst = [3, 9, 1, 14, 7, 20, 11, 5, 16], [2, 17, 8, 23, 12, 4, 19, 6, 21]
        assert backend.store_async(tokens, src, 0).result() == 2 * CHUNK + BS
        assert block_id_checks == [False]  # the store's one check
        before = [layer.clone() for layer in kv.layers]
        assert backend.retrieve(tokens, dst, BS) == 2 * CHUNK + BS  # the tail is found: its block in the one check
        assert block_id_checks == [False, True]
        for layer, old in zip(kv.layers, before, strict=True):
            assert torch.equal(layer[dst[1:]], old[src[1:]])
            untouched = [b for b in range(NB) if b not in dst[1:]]
            assert torch.equal(layer[untouched], old[untouched])
    finally:
        backend.close()


def test_server_store_and_load_check_their_block_ids_once(block_id_checks: list[bool]) -> None:
    """Through a server in this process. The client packs the ids as the protocol's uint32 (refusing what cannot be
    packed) but does not check them (it knows no pool size): `check_block_ids` runs in the server's process only,
    in its cache engine, once per request; the server's transfer takes the checked ids."""
    config = KvferryConfig.load(env={}, overrides={"cache": {"chunk_size": REAL_CHUNK}})
    engine = CacheEngine(config, pool=HostPool(16 << 20, pin=False))
    server = KvferryServer(ServerConfig(port=0, http_port=0), engine)
    server.start()
    try:
        with KvferryClient(f"tcp://127.0.0.1:{server.port}", timeout_s=10) as client:
            source, target = real_kv(1), real_kv(2)
            writer = client.register_kv_cache(source, FMT_REAL, namespace=REAL_NS)
            reader = client.register_kv_cache(target, FMT_REAL, namespace=REAL_NS)
            tokens = list(range(1000, 1000 + 2 * REAL_CHUNK))
            src = random.Random(5).sample(range(2 * PER_CHUNK, 6 * PER_CHUNK), 2 * PER_CHUNK)
            dst = list(range(2 * PER_CHUNK))
            assert client.store(writer, tokens, src) == 2 * REAL_CHUNK
            assert block_id_checks == [False]
            assert client.retrieve(reader, tokens, dst) == 2 * REAL_CHUNK
            assert block_id_checks == [False, True]
            assert torch.equal(blocks(target, dst), blocks(source, src))
    finally:
        server.stop()
        engine.close()

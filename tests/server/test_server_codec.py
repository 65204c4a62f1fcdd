"""Clients of one server choose their objects' codec at registration: fp8 and exact objects live side by side."""

from __future__ import annotations

import pytest
import torch

from kvferry.cache import CacheEngine
from kvferry.client import KvferryClient, ServerError
from kvferry.config import KvferryConfig, ServerConfig
from kvferry.memory import HostPool
from kvferry.server import KvferryServer
from tests.server.serverkit import FMT_REAL, PER_CHUNK, REAL_CHUNK, REAL_NS, real_kv


def test_clients_choose_fp8_or_exact_objects() -> None:
    config = KvferryConfig.load(env={}, overrides={"cache": {"chunk_size": REAL_CHUNK}})
    engine = CacheEngine(config, pool=HostPool(16 << 20, pin=False))
    server = KvferryServer(ServerConfig(port=0, http_port=0), engine)
    server.start()
    try:
        with KvferryClient(f"tcp://127.0.0.1:{server.port}", timeout_s=10) as client:
            source, target, exact_kv = real_kv(1), real_kv(2), real_kv(3)
            fp8 = client.register_kv_cache(source, FMT_REAL, namespace={**REAL_NS, "codec": "fp8"})
            reader = client.register_kv_cache(target, FMT_REAL, namespace={**REAL_NS, "codec": "fp8"})
            exact = client.register_kv_cache(exact_kv, FMT_REAL, namespace=REAL_NS)
            tokens = list(range(2 * REAL_CHUNK))
            ids = list(range(2 * PER_CHUNK))
            assert client.store(fp8, tokens, ids) == 2 * REAL_CHUNK
            assert client.lookup(tokens, registration=exact).tokens == 0  # exact engines never get fp8 objects
            ns = engine.namespace_for(REAL_NS["model"], FMT_REAL, source, salt=REAL_NS["salt"])  # exact objects'
            scheduler = {**REAL_NS, "kv_dtype": ns.kv_dtype, "layout": ns.layout}  # a scheduler knows no codec:
            assert client.lookup(tokens, namespace=scheduler).tokens == 0  # the server's default (none) applies
            scheduler["codec"] = "fp8"
            assert client.lookup(tokens, namespace=scheduler).tokens == 2 * REAL_CHUNK
            assert client.retrieve(reader, tokens, ids) == 2 * REAL_CHUNK
            for a, b in zip(source, target, strict=True):
                got, want = b[:, : 2 * PER_CHUNK].float(), a[:, : 2 * PER_CHUNK].float()
                assert not torch.equal(got, want) and torch.allclose(got, want, rtol=2**-4, atol=0.02)
            with pytest.raises(ServerError, match="bf16 and fp16"):
                client.register_kv_cache(
                    [t.float() for t in real_kv(4)], FMT_REAL, namespace={**REAL_NS, "codec": "fp8"}
                )
    finally:
        server.stop()
        engine.close()

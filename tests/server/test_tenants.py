"""Tenants on one server (`security.tenants`): each client key uses only its own namespaces. Another tenant's
objects are never read, overwritten, demoted or cleared, and a lookup of them misses with a plain miss's answer."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from kvferry.cache import CacheEngine
from kvferry.client import KvferryClient, ServerError
from kvferry.config import KvferryConfig, ServerConfig
from kvferry.memory import HostPool
from kvferry.security import ClientCurve, SecurityConfig
from kvferry.server import KvferryServer
from tests.server.serverkit import FMT_REAL, PER_CHUNK, REAL_CHUNK, blocks, real_kv

CHUNK_BYTES = 4 * 2 * REAL_CHUNK * 2 * 32 * 2  # serverkit's real KV: 4 layers, K and V, 2 heads of 32, bf16
MODEL = "tests/tenants"
A_NS, B_NS = {"model": MODEL, "salt": "team-a"}, {"model": MODEL, "salt": "team-b"}
IDS = list(range(4 * PER_CHUNK))


class Fleet:
    """A CURVE server over a real cache engine of 10 chunks (its pool shared, as for direct transfers), with tenants
    a and b and an operator key."""

    def __init__(self, tmp_path: Path) -> None:
        self.server_keys = zmq.curve_keypair()
        self.keys = {who: zmq.curve_keypair() for who in ("a", "b", "operator")}
        (tmp_path / "operators").write_text(self.keys["operator"][0].decode())
        tenants = [
            {"name": who, "public_key": self.keys[who][0].decode(), "namespaces": [{"model": MODEL, "salt": salt}]}
            for who, salt in (("a", "team-a"), ("b", "team-b"))
        ]
        security = SecurityConfig.model_validate(
            {
                "curve_secret_key": self.server_keys[1].decode(),
                "curve_client_keys": str(tmp_path / "operators"),
                "tenants": tenants,
            }
        )
        config = KvferryConfig.load(
            env={}, overrides={"cache": {"chunk_size": REAL_CHUNK, "watermark": 1.0, "eviction_batch": 1}}
        )
        self.engine = CacheEngine(config, pool=HostPool(10 * CHUNK_BYTES, pin=False, shared=True))
        self.server = KvferryServer(ServerConfig(port=0, http_port=None), self.engine, security=security)
        self.server.start()

    def client(self, who: str) -> KvferryClient:
        public, secret = self.keys[who]
        curve = ClientCurve(server_public=self.server_keys[0], public=public, secret=secret)
        return KvferryClient(f"tcp://127.0.0.1:{self.server.port}", timeout_s=10, curve=curve)

    def explicit(self, deployment: dict[str, str]) -> dict[str, Any]:
        """A key space as a process without KV names it (a scheduler's lookups)."""
        namespace = self.engine.namespace_for(MODEL, FMT_REAL, real_kv(1), salt=deployment["salt"])
        return {**deployment, "kv_dtype": namespace.kv_dtype, "layout": namespace.layout}

    def close(self) -> None:
        self.server.stop()
        self.engine.close()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path)
    yield fleet
    fleet.close()


def _tokens(base: int, chunks: int = 4) -> list[int]:
    return list(range(base, base + chunks * REAL_CHUNK))


def test_a_tenant_cannot_register_in_another_tenants_namespace(fleet: Fleet, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvferry.server")
    with fleet.client("b") as b:
        with pytest.raises(ServerError, match=r"BAD_ARGUMENT.*not one this client's tenant may use"):
            b.register_kv_cache(real_kv(2), FMT_REAL, namespace=A_NS)
        with pytest.raises(ServerError, match="BAD_ARGUMENT"):  # a derived salt of another's is another's
            b.register_kv_cache(real_kv(2), FMT_REAL, namespace={"model": MODEL, "salt": "team-a|x"})
        assert b.register_kv_cache(real_kv(2), FMT_REAL, namespace={"model": MODEL, "salt": "team-b|x"}) >= 0
    assert "tenant b may not register KV in model 'tests/tenants' salt 'team-a'" in caplog.text


def test_another_tenants_prefix_misses_like_a_plain_miss(fleet: Fleet) -> None:
    tokens = _tokens(0)
    with fleet.client("a") as a, fleet.client("b") as b:
        reg = a.register_kv_cache(real_kv(1), FMT_REAL, namespace=A_NS)
        assert a.store(reg, tokens, IDS) == 4 * REAL_CHUNK
        assert a.lookup(tokens, namespace=fleet.explicit(A_NS)).tokens == 4 * REAL_CHUNK  # its own: a hit
        for lock in (False, True):
            foreign = b.lookup(tokens, namespace=fleet.explicit(A_NS), lock=lock)
            plain = b.lookup(_tokens(50_000), namespace=fleet.explicit(B_NS), lock=lock)
            assert foreign == plain and foreign.tokens == 0 and foreign.lock is None
        prefetch = b.prefetch(tokens, namespace=fleet.explicit(A_NS))
        status = b.prefetch_status(prefetch)
        assert status.done and status.tokens == 0
        # The operator's key may use every namespace
        with fleet.client("operator") as operator:
            assert operator.lookup(tokens, namespace=fleet.explicit(A_NS)).tokens == 4 * REAL_CHUNK


def test_a_tenant_is_not_handed_the_shared_pool(fleet: Fleet) -> None:
    """The pool holds every tenant's objects: a tenant's LOCATE is refused, and its locating LOOKUP only locks (the
    operator's is located)."""
    tokens = _tokens(20_000, chunks=2)
    with fleet.client("a") as a, fleet.client("operator") as operator:
        reg = a.register_kv_cache(real_kv(1), FMT_REAL, namespace=A_NS)
        assert a.store(reg, tokens, IDS[: 2 * PER_CHUNK]) == 2 * REAL_CHUNK
        with pytest.raises(ServerError, match=r"FORBIDDEN.*not for a tenant \(a\)"):
            a.locate_async(tokens, registration=reg).result(timeout=10)
        found = a.lookup(tokens, registration=reg, lock=True, locate=True)
        assert found.tokens == 2 * REAL_CHUNK and found.located is None and found.lock is not None
        assert a.free_lookup_locks(found.lock)
        located = operator.lookup(tokens, namespace=fleet.explicit(A_NS), lock=True, locate=True)
        assert located.located is not None and located.located.tokens == 2 * REAL_CHUNK
        assert operator.free_lookup_locks(located.lock)


def test_a_tenant_cannot_read_or_overwrite_another_tenants_objects(fleet: Fleet) -> None:
    tokens = _tokens(0)
    kv_a, kv_b = real_kv(1), real_kv(2)
    with fleet.client("a") as a, fleet.client("b") as b:
        reg_a = a.register_kv_cache(kv_a, FMT_REAL, namespace=A_NS)
        assert a.store(reg_a, tokens, IDS) == 4 * REAL_CHUNK
        reg_b = b.register_kv_cache(kv_b, FMT_REAL, namespace=B_NS)
        # a's registration is a's session's: b naming it is refused
        for transfer in (b.retrieve, b.store):
            with pytest.raises(ServerError, match="UNKNOWN_REGISTRATION"):
                transfer(reg_a, tokens, IDS)
        assert b.retrieve(reg_b, tokens, IDS) == 0  # b's own key space does not hold a's prefix
        assert b.store(reg_b, tokens, IDS) == 4 * REAL_CHUNK  # the same tokens, b's KV: b's own objects
        into = real_kv(3)
        reg_read = a.register_kv_cache(into, FMT_REAL, namespace=A_NS)
        assert a.retrieve(reg_read, tokens, IDS) == 4 * REAL_CHUNK
        assert torch.equal(blocks(into, IDS), blocks(kv_a, IDS))  # a's KV, not b's
        assert not torch.equal(blocks(kv_a, IDS), blocks(kv_b, IDS))


def test_a_tenant_cannot_demote_clear_or_count_another_tenants_objects(fleet: Fleet) -> None:
    old, windowed, new = _tokens(0), _tokens(10_000), _tokens(20_000)
    with fleet.client("a") as a, fleet.client("b") as b:
        reg = a.register_kv_cache(real_kv(1), FMT_REAL, namespace=A_NS)
        assert a.store(reg, old, IDS) == a.store(reg, windowed, IDS) == 4 * REAL_CHUNK
        # b's demote of a's chunks answers as any demote does, and moves nothing
        assert b.demote_async(windowed, range(2), namespace=fleet.explicit(A_NS)).result(timeout=10) == 2
        with pytest.raises(ServerError, match="FORBIDDEN"):
            b.clear()
        with pytest.raises(ServerError, match="FORBIDDEN"):
            b.stats()
        assert a.store(reg, new, IDS) == 4 * REAL_CHUNK  # the pool holds 10 chunks: 2 are evicted
        # In plain LRU order: `old`'s first chunks went, not the `windowed` chunks b tried to demote
        assert a.lookup(old, registration=reg).tokens == 0
        assert a.lookup(windowed, registration=reg).tokens == 4 * REAL_CHUNK
        assert a.lookup(new, registration=reg).tokens == 4 * REAL_CHUNK
    with fleet.client("operator") as operator:
        assert operator.stats()["cache"]["evictions"] == 2

"""The connector's layers kept exact beside fp8 (`layer_parts`), embedded and through a server, and its codec
setting's refusals at start: KV tensors shaped like vLLM's CPU backend, no vLLM engine."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvferry.cache import CacheEngine
from kvferry.config import KvferryConfig, ServerConfig
from kvferry.connector import layer_parts
from kvferry.connector.backends import Hit
from kvferry.connector.engine_kv import EngineKV
from kvferry.connector.plan import LoadSpec, StepPlan, StoreSpec
from kvferry.connector.server_link import ServerLink
from kvferry.connector.settings import ConnectorSettings
from kvferry.connector.worker_side import WorkerSide
from kvferry.integrations.vllm.kv_layout import recognise
from kvferry.memory import HostPool
from kvferry.server import KvferryServer

BS, CHUNK, NB, NL = 32, 128, 16, 4
BOUND = 2**-4 + 2**-8  # of a group's largest magnitude (docs/codec.md)
SRC, DST = [3, 9, 1, 14, 7, 12, 11, 5, 0], [2, 0, 8, 13, 10, 4, 15, 6, 1]


def _kv(seed: int, dtype: torch.dtype = torch.bfloat16) -> EngineKV:
    buf = torch.randn(NL, NB, 2, BS, 128, generator=torch.Generator().manual_seed(seed)).to(dtype)
    cache_dtype = "fp8" if dtype == torch.uint8 else "auto"  # vLLM's fp8 caches are uint8 tensors
    return recognise({f"model.layers.{i}.attn": buf[i] for i in range(NL)}, isa="vec", kv_cache_dtype=cache_dtype)


def _embedded(**settings: Any) -> ConnectorSettings:
    config = {"cache": {"chunk_size": CHUNK, "l1_size_gb": 0.02}}
    return ConnectorSettings.from_extra_config({"config": config, **settings})


@pytest.fixture
def server() -> Iterator[KvferryServer]:
    config = KvferryConfig.load(env={}, overrides={"cache": {"chunk_size": CHUNK, "codec": "fp8"}})
    engine = CacheEngine(config, pool=HostPool(16 << 20, pin=False))
    server = KvferryServer(ServerConfig(port=0, http_port=0), engine)
    server.start()
    yield server
    server.stop()
    engine.close()


def _make(settings: ConnectorSettings, kv: EngineKV, exact: list[int], **kwargs: Any) -> Any:
    positions = layer_parts.exact_positions(kv, kv.layer_names, exact)
    return layer_parts.make_backend(
        settings, kv, exact_layers=positions, model="tiny", block_size=BS, name="test", **kwargs
    )


def _store_then_load(settings: ConnectorSettings, lookups_of: Any = None) -> tuple[EngineKV, EngineKV]:
    """Stores 288 tokens (2 chunks and a tail) from one engine's blocks; a second engine looks them up and loads
    them after its own first two blocks. Returns both engines' KV."""
    src, dst = _kv(1), _kv(2)
    tokens = [random.Random(3).randrange(32_000) for _ in range(300)]
    writer = _make(settings, src, [0, -1])
    reader = _make(settings, dst, [0, -1], engine=layer_parts.engine_of(writer))
    assert isinstance(writer, layer_parts.LayerSplitBackend) and len(writer.backends) == 2
    try:
        worker = WorkerSide(writer, block_size=BS)
        worker.start_stores(StepPlan(stores=[StoreSpec("a", tokens[: 9 * BS], SRC, skip_tokens=0)]))
        worker.preempted(["a"])  # waits for its stores
        lookups = reader if lookups_of is None else lookups_of(reader)
        hit = lookups.lookup(tokens)
        assert hit is not None and hit.tokens == 9 * BS  # 2 chunks, then the tail's whole blocks, in every part
        lookups.free_lock(hit.lock)
        plain = _make(settings, _kv(4), [])  # the model's unsplit fp8 key space shares none of it
        assert plain.lookup(tokens) == Hit(0)
        plain.close()
        loader = WorkerSide(reader, block_size=BS)
        loader.start_loads(StepPlan(loads=[LoadSpec("b", tokens[: 9 * BS], DST[:9], skip_tokens=2 * BS)]))
        assert loader.take_load_errors() == set()
    finally:
        writer.close()
        reader.close()
    return src, dst


def _check_layers(src: EngineKV, dst: EngineKV) -> None:
    for i, (a, b) in enumerate(zip(src.layers, dst.layers, strict=True)):
        got, want = b[DST[2:]].float(), a[SRC[2:]].float()
        if i in (0, NL - 1):
            assert torch.equal(got, want)  # exact layers: vLLM's bytes
        else:
            assert bool(((got - want).abs() <= want.abs().amax() * BOUND).all()) and not torch.equal(got, want)
    assert not torch.equal(dst.layers[0][DST[:2]], src.layers[0][SRC[:2]])  # vLLM's own prefix: never written


def test_embedded_exact_layers_round_trip_bit_exact() -> None:
    _check_layers(*_store_then_load(_embedded(codec="fp8", exact_layers=[0, -1])))


def test_embedded_exact_layers_from_the_config() -> None:
    settings = ConnectorSettings.from_extra_config(
        {"config": {"cache": {"chunk_size": CHUNK, "l1_size_gb": 0.02, "codec": "fp8", "exact_layers": [0, 3]}}}
    )
    assert settings.objects_codec() == "fp8" and settings.objects_exact_layers() == [0, 3]


def test_server_mode_exact_layers_and_a_scheduler_in_another_process(server: KvferryServer) -> None:
    url = f"tcp://127.0.0.1:{server.port}"
    settings = ConnectorSettings(mode="server", server_url=url, timeout_s=10, codec="fp8", exact_layers=[0, -1])
    links: list[ServerLink] = []

    def scheduler_lookups(reader: Any) -> Any:  # what a scheduler half makes of the worker's handshake
        link = ServerLink(url, timeout_s=10)
        links.append(link)
        link.connect()
        return layer_parts.lookups_from_fields(link, layer_parts.key_space_fields(reader), BS)

    try:
        _check_layers(*_store_then_load(settings, scheduler_lookups))
    finally:
        for link in links:
            link.close()


@pytest.mark.parametrize(
    ("dtype", "why"), [(torch.float32, "bf16 and fp16"), (torch.uint8, "fp8 already"), (torch.float16, None)]
)
@pytest.mark.parametrize("mode", ["embedded", "server"])
def test_a_codec_the_kv_cannot_take_refuses_to_start(dtype: torch.dtype, why: str | None, mode: str) -> None:
    settings = (
        _embedded(codec="fp8")
        if mode == "embedded"
        else ConnectorSettings(mode="server", server_url="tcp://127.0.0.1:9", timeout_s=0.2, codec="fp8")
    )
    if why is None:  # fp16 takes it (server mode: the server is not there, so the link is down, not refused)
        _make(settings, _kv(1, dtype), []).close()
        return
    with pytest.raises(ValueError, match=why):
        _make(settings, _kv(1, dtype), [])


def test_the_servers_default_codec_refuses_at_start_too(server: KvferryServer) -> None:
    settings = ConnectorSettings(mode="server", server_url=f"tcp://127.0.0.1:{server.port}", timeout_s=10)
    with pytest.raises(ValueError, match=r"refused this engine's KV cache: .*bf16 and fp16"):
        _make(settings, _kv(1, torch.float32), [])


def test_settings_refusals() -> None:
    with pytest.raises(ValueError, match="exact_layers in server mode needs this engine's codec"):
        ConnectorSettings.from_extra_config({"mode": "server", "exact_layers": [0]})
    with pytest.raises(ValueError, match="codec"):
        ConnectorSettings.from_extra_config({"codec": "fp4"})
    with pytest.raises(ValueError, match=r"\[4\] are not attention layers"):
        layer_parts.exact_positions(_kv(1), _kv(1).layer_names, [0, 4])


def test_a_hybrid_models_groups_split_by_the_models_layer_positions() -> None:
    from kvferry.connector.hybrid_worker import start_hybrid_worker
    from kvferry.connector.kv_groups import KVGroup

    kv = _kv(1)
    names = kv.layer_names  # model.layers.0 .. 3: the sliding group holds 0 and 2, the full group 1 and 3
    kvs = [layer_parts.part_kv(kv, [0, 2]), layer_parts.part_kv(kv, [1, 3])]
    groups = [
        KVGroup(0, "sliding_window", BS, tuple(kvs[0].layer_names), 64),
        KVGroup(1, "full", BS, tuple(kvs[1].layer_names)),
    ]
    hybrid = start_hybrid_worker(
        _embedded(codec="fp8", exact_layers=[-1]), kvs, groups, model="tiny", name="test", model_layers=names
    )
    try:
        sliding, full = hybrid.lookups.backends
        assert not isinstance(sliding, layer_parts.LayerSplitBackend)  # no exact layer: all fp8
        assert isinstance(full, layer_parts.LayerSplitBackend)  # layer 3, the full group's second, kept exact
        assert [(p.kv.layer_names, p.namespace.codec) for p in full.backends] == [
            ([names[3]], "none"),
            ([names[1]], "fp8"),
        ]
        split_names = {(part["salt"], part["group"], part["split"]) for part in hybrid.key_spaces[1]}
        assert split_names == {("", "group=1:full", "exact_layers=1")} and hybrid.key_spaces[0]["codec"] == "fp8"
    finally:
        hybrid.worker.close()
        hybrid.lookups.close()

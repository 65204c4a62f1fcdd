"""kvferry's blocks in vLLM's KV events: vLLM's own scheduler (`vllm_sim`) with kvferry as its connector publishes
``BlockStored`` (medium CPU, vLLM's block hashes and token ids) for what kvferry stored and ``BlockRemoved`` once
for each block kvferry evicts, decoded with vLLM's own event classes; embedded and server mode."""

from __future__ import annotations

import importlib.util
import random
import time
from collections import Counter
from typing import Any

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm extra"),
]

CHUNK = 64
BS = 16
POOL_GB = 0.0008  # 6 chunks of the stand-in model (128 KiB each): a few prompts evict
PROMPTS = 6  # of 4 whole chunks each
# One store thread (the cache's async worker; the server's transfer worker): a request's stores run in the order
# they were issued, as the probes below expect. On two threads the chunk store of a prompt's prefill may run after
# the store of its finish, its tail (seen once on a loaded CI machine).
CACHE = {"chunk_size": CHUNK, "l1_size_gb": POOL_GB, "async_workers": 1}


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(300)]


def _kvferry_events(engine: Any) -> list[Any]:
    return [e for batch in engine.published for e in batch.events if getattr(e, "ownership", None) == "kvferry"]


def _run(engine: Any, prompts: list[list[int]]) -> dict[str, list[Any]]:
    """Runs each prompt to its end; vLLM's block hashes of each (as its engine core computes them), as its events
    name them."""
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    from vllm.v1.request import Request

    hashes = {}
    for i, tokens in enumerate(prompts):
        engine.add(f"r{i}", tokens)
        probe = Request("probe", tokens, SamplingParams(), None, block_hasher=engine._block_hasher)
        hashes[f"r{i}"] = [maybe_convert_block_hash(h) for h in probe.block_hashes]
        engine.run()
        engine.scheduler.reset_prefix_cache()  # the next prompt's chunks come from kvferry's pool, or are recomputed
    return hashes


WINDOW_GROUP, FULL_GROUP = 0, 1  # the hybrid stand-in's groups (`vllm_sim.kv_cache_config`)
SPECS = {WINDOW_GROUP: ("sliding_window", 32), FULL_GROUP: ("full_attention", None)}


def _groups(engine: Any) -> list[int]:
    return [FULL_GROUP, WINDOW_GROUP] if len(engine.kv_cache_config.kv_cache_groups) > 1 else [0]


def _check(engine: Any, prompts: list[list[int]], hashes: dict[str, list[Any]], deadline_s: float = 0.0) -> None:
    """Each group's blocks (a hybrid's two groups on their own, as vLLM's own events name them): every prompt's whole
    chunks announced in the full-attention group with their tokens and parents (the window group: at least each
    prompt's last chunk, the one no longer prompt of it supersedes), each block removed once per group and only
    after it was announced there, and what stays announced fits the pool."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    groups = _groups(engine)
    per_chunk = CHUNK // BS
    until = time.monotonic() + deadline_s
    while True:
        events = _kvferry_events(engine)
        stored = [e for e in events if isinstance(e, BlockStored)]
        full = {h for e in stored if e.group_idx == groups[0] for h in e.block_hashes}
        removed_any = [e for e in events if isinstance(e, BlockRemoved)]
        if (len(full) == PROMPTS * 4 * per_chunk and removed_any) or time.monotonic() > until:
            break
        engine.step()  # an idle step: the scheduler takes the connector's events as it publishes its own
    assert all(e.medium == "CPU" and e.block_size == BS and e.group_idx in groups for e in stored)
    if len(groups) > 1:
        assert all((e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) == SPECS[e.group_idx] for e in stored)
    held = 0
    for group in groups:
        own = [e for e in stored if e.group_idx == group]
        announced = {h for e in own for h in e.block_hashes}
        removed = Counter(h for e in events if isinstance(e, BlockRemoved) and e.group_idx == group
                          for h in e.block_hashes)  # fmt: skip
        tokens_of = {h: list(e.token_ids[i * BS : (i + 1) * BS]) for e in own for i, h in enumerate(e.block_hashes)}
        parent_of = {e.block_hashes[0]: e.parent_block_hash for e in own}
        for i, tokens in enumerate(prompts):
            expected = hashes[f"r{i}"][: 4 * per_chunk]
            chunks = range(4) if group == groups[0] else range(3, 4)
            assert {h for c in chunks for h in expected[c * per_chunk : (c + 1) * per_chunk]} <= announced
            assert all(tokens_of[h] == tokens[b * BS : (b + 1) * BS] for b, h in enumerate(expected) if h in announced)
            assert all(parent_of.get(h, expected[b - 1] if b else None) == (expected[b - 1] if b else None)
                       for b, h in enumerate(expected) if h in announced)  # fmt: skip
        assert max(removed.values(), default=1) == 1 and set(removed) <= announced
        assert sum(len(e.block_hashes) for e in own) == len(announced)  # each announced once (no spill, no tier)
        held += len(announced - set(removed))
    assert removed_any and held <= 6 * len(groups) * per_chunk  # the pool's 6 chunks of every group's layers


def _held(engine: Any, group: int) -> set[Any]:
    """The blocks of ``group`` kvferry holds in its pool, as a router following vLLM's events alone knows them."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    held: set[Any] = set()
    for event in _kvferry_events(engine):
        if getattr(event, "medium", None) != "CPU" or event.group_idx != group:
            continue
        if isinstance(event, BlockStored):
            held.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            held.difference_update(event.block_hashes)
    return held


def _predicted(engine: Any, hashes: list[Any]) -> int:
    """The tokens a router predicts kvferry loads for a prompt of ``hashes``, from the events: the leading blocks
    the full-attention group holds; for a hybrid, in whole chunks whose last chunk's window blocks (the last
    ``WINDOW`` tokens before the hit) the sliding-window group holds too, as vLLM's hybrid prefix hits are found."""
    groups = _groups(engine)
    full = _held(engine, groups[0])
    leading = next((b for b, h in enumerate(hashes) if h not in full), len(hashes)) * BS
    if len(groups) == 1:
        return leading
    window = _held(engine, WINDOW_GROUP)
    chunks = leading // CHUNK
    size = SPECS[WINDOW_GROUP][1]
    while chunks and not all(hashes[b] in window for b in range((chunks * CHUNK - size) // BS, chunks * CHUNK // BS)):
        chunks -= 1
    return chunks * CHUNK


def _check_predictions(engine: Any, prompts: list[list[int]], deadline_s: float = 0.0) -> None:
    """Probe prompts (a stored prompt continued, one that leaves it inside its third chunk, an evicted one): the
    tokens the events say kvferry holds of each, rounded down to whole chunks (what kvferry loads), are at most
    the hit kvferry reports for it, and short of it by less than a chunk (a request's last partial chunk, stored as
    a tail, is not announced)."""
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    from vllm.v1.request import Request

    tail = 32 if len(engine.kv_cache_config.kv_cache_groups) == 1 else 0  # a hybrid model stores no tails
    last = prompts[-1]
    probes = [[*last, *_prompt(99)[:40]], [*last[:150], *_prompt(98)], [*prompts[0], *_prompt(97)[:40]]]
    side = engine.scheduler_side
    for i, tokens in enumerate(probes):
        engine.scheduler.reset_prefix_cache()  # vLLM's own prefix cache forgets: the hit is kvferry's alone
        probe = Request("probe", tokens, SamplingParams(), None, block_hasher=engine._block_hasher)
        hashes = [maybe_convert_block_hash(h) for h in probe.block_hashes]
        until = time.monotonic() + deadline_s
        while True:  # the events of the last prompts' stores and evictions, as the scheduler publishes them
            engine.step()
            predicted = _predicted(engine, hashes)
            if i != 0 or predicted >= 4 * CHUNK or time.monotonic() > until:
                break
        before = side.counters.lookup_hit_tokens
        engine.add(f"probe{i}", tokens)
        engine.run()
        hit = side.counters.lookup_hit_tokens - before
        assert predicted // CHUNK * CHUNK <= hit < predicted // CHUNK * CHUNK + CHUNK, (i, predicted, hit)
        if tail:
            assert (predicted, hit) == [(4 * CHUNK, 4 * CHUNK + tail), (144, 2 * CHUNK), (0, 0)][i]
        else:  # the window's objects of a prompt's earlier chunks go first once a longer one supersedes them
            assert predicted == hit, (i, predicted, hit)
            assert hit in [(4 * CHUNK,), (0, CHUNK, 2 * CHUNK), (0,)][i]


@pytest.mark.parametrize("hybrid", [False, True], ids=["one-group", "hybrid"])
def test_embedded_kvferry_blocks_reach_vllms_kv_events(engines: list[Any], model: str, hybrid: bool) -> None:
    from tests.integrations.vllm_sim import SimEngine

    extra = {"mode": "embedded", "config": {"cache": CACHE}}
    engine = SimEngine(model, extra, kv_events=True, hybrid=hybrid)
    engines.append(engine)
    prompts = [_prompt(seed) for seed in range(PROMPTS)]
    hashes = _run(engine, prompts)
    # vLLM's own events for the same blocks (medium GPU) name them by the same hashes
    own = {h for b in engine.published for e in b.events if getattr(e, "medium", None) == "GPU"
           for h in getattr(e, "block_hashes", ())}  # fmt: skip
    assert set(hashes["r0"][:16]) <= own
    _check(engine, prompts, hashes)
    _check_predictions(engine, prompts)


@pytest.mark.parametrize("hybrid", [False, True], ids=["one-group", "hybrid"])
def test_server_mode_kvferry_blocks_reach_vllms_kv_events(engines: list[Any], model: str, hybrid: bool) -> None:
    from kvferry.cache import CacheEngine
    from kvferry.config import KvferryConfig, ServerConfig
    from kvferry.server import KvferryServer
    from tests.integrations.vllm_sim import SimEngine

    cache = CacheEngine(KvferryConfig.load(env={}, overrides={"cache": CACHE}))
    # Ports the server binds itself (0): a port probed free and closed again was taken by another process meanwhile.
    ports = {"port": 0, "http_port": 0, "events_port": 0, "events_replay_port": 0}
    server = KvferryServer(ServerConfig(**ports, transfer_workers=1), cache)
    server.start()
    port, pub, replay = server.port, server.events_port, server.events_replay_port
    try:
        extra = {"mode": "server", "server_url": f"tcp://127.0.0.1:{port}",
                 "events_url": f"tcp://127.0.0.1:{pub},tcp://127.0.0.1:{replay}"}  # fmt: skip
        engine = SimEngine(model, extra, kv_events=True, hybrid=hybrid)
        engines.append(engine)
        prompts = [_prompt(seed) for seed in range(10, 10 + PROMPTS)]
        hashes = _run(engine, prompts)
        _check(engine, prompts, hashes, deadline_s=60.0)  # ends once all are in (loaded CI: > 20 s)
        _check_predictions(engine, prompts, deadline_s=60.0)
        engines.remove(engine)
        engine.shutdown()
    finally:
        server.stop()
        cache.close()


@pytest.mark.parametrize("kind", ["mamba", "other-block-size"])
def test_a_model_whose_hits_events_cannot_predict_is_not_announced(kind: str, caplog: pytest.LogCaptureFixture) -> None:
    """A Mamba group keeps states at some chunk boundaries only, and a group of another block size has blocks vLLM's
    request hashes do not name: announcing either would promise hits kvferry cannot load. One warning instead."""
    from types import SimpleNamespace

    from kvferry.connector.kv_groups import KVGroup
    from kvferry.connector.settings import ConnectorSettings
    from kvferry.integrations.vllm.kv_events import kv_events_for

    second = KVGroup(1, "mamba", BS, ("model.layers.1.mixer",)) if kind == "mamba" else \
        KVGroup(1, "sliding_window", 2 * BS, ("model.layers.1.self_attn.attn",), window=32)  # fmt: skip
    groups = [KVGroup(0, "full", BS, ("model.layers.0.self_attn.attn",)), second]
    vllm_config = SimpleNamespace(kv_events_config=SimpleNamespace(enable_kv_cache_events=True))
    settings = ConnectorSettings.from_extra_config({"mode": "embedded"})
    with caplog.at_level("WARNING", logger="kvferry.integrations.vllm.kv_events"):
        events = kv_events_for(vllm_config, settings, None, groups, block_size=BS, chunk_size=CHUNK)  # type: ignore[arg-type]
    assert events is None
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "not among them" in caplog.text

"""The connector driven by the installed vLLM's own scheduler, KV cache manager and KV allocation (`vllm_sim`): new,
running, preempted-and-resumed and finished requests, kvferry's prefix hits (every loaded block checked byte for
byte), a failed load, a hybrid model, embedded and server mode. `test_vllm_releases` runs this module again over
each released vLLM kvferry supports."""

from __future__ import annotations

import importlib.util
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.shm import in_use_elsewhere
from tests.ports import port_for_a_restart

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm extra"),
]

CHUNK = 64
EMBEDDED = {"mode": "embedded", "config": {"cache": {"chunk_size": CHUNK, "l1_size_gb": 0.02}}}


def make(engines: list[Any], model: str, extra: dict[str, Any] = EMBEDDED, **kwargs: Any) -> Any:
    from tests.integrations.vllm_sim import SimEngine

    engine = SimEngine(model, extra, **kwargs)
    engines.append(engine)
    return engine


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def assert_nothing_held(engine: Any) -> None:
    """Every request gone from vLLM and the connector, no lookup lock held, every block back in vLLM's pool."""
    side = engine.scheduler_side
    assert not engine.scheduler.requests
    assert list(side.tracked_requests()) == [] and side.locks_held() == 0
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # all but vLLM's null block


def test_the_vllm_under_test_is_the_one_asked_for() -> None:
    import vllm

    from kvferry.integrations.vllm import vllm_versions

    expected = os.environ.get("KVF_TEST_VLLM_VERSION")
    if expected:
        assert vllm.__version__ == expected and Path(vllm.__file__).is_relative_to(os.environ["KVF_TEST_VLLM_TREE"])
    assert vllm_versions.installed().tested


@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC"])
def test_a_prefix_hit_is_loaded_bit_exact_and_locked_until_loaded(engines: list[Any], model: str, layout: str) -> None:
    engine = make(engines, model, layout=layout)
    first = prompt(300, seed=1)
    engine.add("a", first)
    engine.run()
    assert len(engine.outputs["a"]) == 4 and "a" in engine.finished
    engine.scheduler.reset_prefix_cache()  # vLLM's own prefix cache forgets it: kvferry's hit is what remains
    engine.add("b", [*first, *prompt(40, seed=2)])
    reports = engine.run()
    side = engine.scheduler_side
    # a's 303 computed tokens were stored at its finish in whole blocks (288): b loads them all
    assert vars(side.counters) == {
        "lookup_requests": 2, "lookup_hit_requests": 1, "lookup_hit_tokens": 288, "hit_tokens_taken": 288,
        "requests_resumed": 0,
    }  # fmt: skip
    worker = engine.worker._worker.counters
    assert worker.tokens_loaded == 288 and worker.load_failures == worker.store_failures == 0
    assert reports[0].locks_after_schedule == 1  # the hit stays locked until the load is reported done
    first_run = next(r for r in reports if "b" in r.scheduled)
    assert first_run.computed["b"] == 288 and first_run.checked_blocks == 288 // 16 * 4  # every loaded block read
    assert_nothing_held(engine)


@pytest.mark.parametrize("draft", ["shared", "own"])
def test_a_draft_models_layers_are_loaded_with_the_targets(engines: list[Any], model: str, draft: str) -> None:
    """Speculative decoding (EAGLE, MTP): the draft model's KV layer, in the target's KV cache group or in one of its
    own, is stored and loaded with the target's layers, bit-exact (vLLM's target model verifies every drafted token:
    the draft's KV decides only how many are accepted)."""
    engine = make(engines, model, draft=draft)
    assert len(engine.views) == 5 and len(engine.kv_cache_config.kv_cache_groups) == (1 if draft == "shared" else 2)
    first = prompt(300, seed=11)
    engine.add("a", first)
    engine.run()
    engine.scheduler.reset_prefix_cache()
    engine.add("b", [*first, *prompt(40, seed=12)])
    reports = engine.run()
    first_run = next(r for r in reports if "b" in r.scheduled)
    hit = 288 if draft == "shared" else 256  # a model of several groups stores no tails
    assert first_run.computed["b"] == hit and first_run.checked_blocks == hit // 16 * 5  # the draft's layer too
    assert engine.outputs["b"] == engine.expected_output([*first, *prompt(40, seed=12)], 4)
    assert_nothing_held(engine)


def _fail_loads(engine: Any) -> None:
    """Every load of ``engine``'s connector from now on fails (a tier error), in whichever group."""
    from concurrent.futures import Future

    def fail(*args: Any, **kwargs: Any) -> Future[int]:
        failed: Future[int] = Future()
        failed.set_exception(OSError("injected tier error"))
        return failed

    for backend in engine.worker._worker._backends:
        backend.retrieve_async = fail


def test_a_failed_load_is_recomputed(engines: list[Any], model: str) -> None:
    engine = make(engines, model)
    first = prompt(300, seed=3)
    engine.add("a", first)
    engine.run()
    engine.scheduler.reset_prefix_cache()
    _fail_loads(engine)
    engine.add("b", first)
    reports = engine.run()
    assert engine.worker._worker.counters.load_failures == 1
    assert "b" in engine.finished and engine.outputs["b"] == engine.expected_output(first, 4)
    assert sum(r.scheduled.get("b", 0) for r in reports) >= 300 - 16  # vLLM computed what the load did not bring
    assert_nothing_held(engine)


def test_a_hybrid_models_failed_load_is_reported_by_request_and_recomputed(engines: list[Any], model: str) -> None:
    """vLLM raises inside its scheduler when a model of several KV cache groups reports failed block ids (they are
    per group): the connector loads such a model in the background even when set to load in the foreground, and
    reports a short load by request (``failed_recving``); vLLM recomputes the request from its start."""
    engine = make(engines, model, {**EMBEDDED, "async_load": False}, hybrid=True)
    first = prompt(300, seed=8)
    engine.add("a", first)
    engine.run()
    engine.scheduler.reset_prefix_cache()
    _fail_loads(engine)
    engine.add("b", first)
    reports = engine.run()
    assert engine.worker._worker.counters.load_failures == 1
    assert "b" in engine.finished and engine.outputs["b"] == engine.expected_output(first, 4)
    assert sum(r.scheduled.get("b", 0) for r in reports) >= 300  # the whole prompt again
    assert_nothing_held(engine)


def test_preempted_requests_resume_and_reload_their_stored_chunks(engines: list[Any], model: str) -> None:
    """Two requests that outgrow vLLM's blocks: one is preempted, resumes (listed as vLLM's version lists resumes),
    loads the chunks it stored before from kvferry (vLLM's prefix cache is off), recomputes the rest, and both
    generate what they would have alone."""
    engine = make(engines, model, num_blocks=40, prefix_caching=False)  # 39 blocks; each request needs 20
    prompts = {"a": prompt(300, seed=4), "b": prompt(300, seed=5)}
    for req_id, tokens in prompts.items():
        engine.add(req_id, tokens, max_tokens=20)
    reports = engine.run()
    counters = engine.scheduler_side.counters
    assert [r.preempted for r in reports if r.preempted] == [["b"]]
    assert counters.requests_resumed == 1
    # looked up: a, b, b again at its resume (a hit: its 4 chunks, stored by its prefill)
    assert counters.lookup_requests == 3 and counters.lookup_hit_requests == 1 and counters.hit_tokens_taken == 256
    resumed = [r for r in reports if r.resumed_with_hit]
    assert len(resumed) == 1 and resumed[0].computed["b"] == 256 and resumed[0].checked_blocks == 16 * 4
    for req_id, tokens in prompts.items():
        assert engine.outputs[req_id] == engine.expected_output(tokens, 20)
    assert_nothing_held(engine)


def test_a_hybrid_models_hit_loads_each_group(engines: list[Any], model: str) -> None:
    engine = make(engines, model, hybrid=True)
    first = prompt(300, seed=6)
    engine.add("a", first)
    engine.run()
    engine.scheduler.reset_prefix_cache()
    engine.add("b", [*first, *prompt(30, seed=7)])
    reports = engine.run()
    assert engine.scheduler_side.counters.hit_tokens_taken == 256  # whole chunks every group holds
    first_run = next(r for r in reports if "b" in r.scheduled)
    # the full group's 16 blocks in 2 layers, the sliding group's blocks in its window (2 before 256) in 2 layers
    assert first_run.computed["b"] == 256 and first_run.checked_blocks == 16 * 2 + 2 * 2
    assert_nothing_held(engine)


def test_server_mode_reconnects_lazily_hits_and_leaves_no_shared_memory(engines: list[Any], model: str) -> None:
    from kvferry.cache import CacheEngine
    from kvferry.config import KvferryConfig, ServerConfig
    from kvferry.connector import backends
    from kvferry.server import KvferryServer

    before = set(os.listdir("/dev/shm"))
    port = port_for_a_restart()  # the connector connects before the server listens
    engine = make(engines, model, {"mode": "server", "server_url": f"tcp://127.0.0.1:{port}", "timeout_s": 2.0})
    first = prompt(300, seed=8)
    engine.add("a", first)
    engine.run()  # no server yet: a miss, nothing stored
    assert engine.scheduler_side is None or engine.scheduler_side.counters.hit_tokens_taken == 0
    cache = CacheEngine(KvferryConfig.load(env={}, overrides={"cache": {"chunk_size": CHUNK, "l1_size_gb": 0.02}}))
    server = KvferryServer(ServerConfig(port=port, http_port=0), cache)
    server.start()
    try:
        link = backends.find(engine.vllm_config.kv_transfer_config.engine_id).link
        deadline = time.monotonic() + 30
        while not link.up and time.monotonic() < deadline:
            time.sleep(0.05)
        assert link.up, "the connector did not reconnect"
        engine.add("a2", first)
        engine.run()
        engine.scheduler.reset_prefix_cache()
        engine.add("b", [*first, *prompt(40, seed=9)])
        reports = engine.run()
        # a2's chunks, and its tail (once seen taking a moment longer to show than the store's report: then 256)
        hit = engine.scheduler_side.counters.hit_tokens_taken
        assert hit in (256, 288)
        first_run = next(r for r in reports if "b" in r.scheduled)
        assert first_run.computed["b"] == hit and first_run.checked_blocks == hit // 16 * 4
        assert_nothing_held(engine)
        engines.remove(engine)
        engine.shutdown()
    finally:
        server.stop()
        cache.close()
    new = set(os.listdir("/dev/shm")) - before - in_use_elsewhere()  # another process's segments aside
    mine = {e for e in new if not e.startswith("sem.") and not (e.startswith("torch_") and e.split("_")[1] != pid)}
    assert not mine


pid = str(os.getpid())

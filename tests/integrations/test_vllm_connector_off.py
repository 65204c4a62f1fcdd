"""The connector off while vLLM serves on, through its hooks (vLLM 0.32's config objects, CPU KV): a KV cache
dtype it does not move (refused at start: one ERROR, every lookup a miss), and an error inside a worker hook while
serving (one ERROR; lookups miss; what vLLM waits for is still reported; nothing is written to its blocks)."""

from __future__ import annotations

import importlib.util
import logging
import uuid
from typing import Any

import pytest
import torch

from tests.integrations.vllm_connectors import (
    BLOCK,
    BLOCKS,
    HEAD_SIZE,
    HEADS,
    LAYERS,
    connector,
    request,
    run_plan,
    wait_for,
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm extra"),
]

EMBEDDED = {"mode": "embedded", "config": {"cache": {"chunk_size": 2 * BLOCK, "l1_size_gb": 0.05}}}


def _kv(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    buffer = torch.randn(LAYERS, BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE, generator=gen).bfloat16()
    return {f"model.layers.{i}.self_attn.attn": buffer[i] for i in range(LAYERS)}


def _errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("kvferry")]


@pytest.mark.parametrize("dtype", ["octave_k3v4", "turboquant_k8v4", "nvfp4"])
def test_a_kv_dtype_kvferry_does_not_move_is_refused_once_and_every_lookup_misses(
    caplog: pytest.LogCaptureFixture, dtype: str
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvferry.connector import backends
    from kvferry.integrations.vllm.connector_metadata import KvferryConnectorMetadata

    engine_id = uuid.uuid4().hex
    with caplog.at_level(logging.INFO, logger="kvferry"):
        scheduler = connector(KVConnectorRole.SCHEDULER, EMBEDDED, engine_id, cache_dtype=dtype)
        worker = connector(KVConnectorRole.WORKER, EMBEDDED, engine_id, cache_dtype=dtype)
        worker.register_kv_caches(_kv(1))
        tokens = torch.randint(0, 50_000, (4 * BLOCK,), generator=torch.Generator().manual_seed(2)).tolist()
        for _ in range(3):
            assert scheduler.get_num_new_matched_tokens(request(tokens), 0) == (0, False)
        meta = scheduler.build_connector_meta(object())
    (error,) = _errors(caplog)
    assert "kvferry connector disabled (every lookup is a miss)" in error.getMessage()
    assert repr(dtype) in error.getMessage()
    assert backends.find(engine_id) is None  # nothing registered
    assert isinstance(meta, KvferryConnectorMetadata) and meta.plan.is_empty()
    scheduler.shutdown()
    worker.shutdown()


def test_an_error_in_a_worker_hook_turns_the_engine_s_connectors_off(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvferry.connector.plan import LoadSpec, StepPlan, StoreSpec

    engine_id = uuid.uuid4().hex
    scheduler = connector(KVConnectorRole.SCHEDULER, EMBEDDED, engine_id)
    worker = connector(KVConnectorRole.WORKER, EMBEDDED, engine_id)
    kv = _kv(3)
    rng = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 50_000, (4 * BLOCK,), generator=rng).tolist()
    other = torch.randint(0, 50_000, (4 * BLOCK,), generator=rng).tolist()
    try:
        worker.register_kv_caches(kv)
        run_plan(worker, StepPlan(stores=[StoreSpec("stored", tokens, [3, 7, 1, 9], 0)]))
        wait_for(lambda: worker.get_finished({"stored"})[0] == {"stored"}, what="the store")
        assert scheduler.get_num_new_matched_tokens(request([*tokens, 1]), 0) == (4 * BLOCK, True)

        side = worker._worker
        start_stores = side.start_stores
        calls = {"n": 0}

        def drifted(plan: Any) -> None:  # an API drift met once, while serving
            calls["n"] += 1
            if calls["n"] == 1:
                raise AttributeError("'StoreSpec' object has no attribute 'injected_drift'")
            start_stores(plan)

        monkeypatch.setattr(side, "start_stores", drifted)
        with caplog.at_level(logging.DEBUG, logger="kvferry"):
            run_plan(worker, StepPlan(stores=[StoreSpec("saving", other, [2, 4, 5, 6], 0)]))  # trips
            assert scheduler.get_num_new_matched_tokens(request([*tokens, 2]), 0) == (0, False)  # off: a miss
            # A background load and a store the scheduler planned before it heard: refused, and reported.
            before = {name: t.clone() for name, t in kv.items()}
            plan = StepPlan(
                loads=[LoadSpec("loading", tokens, [0, 8, 10, 11], 0, in_background=True)],
                stores=[StoreSpec("saving", other, [2, 4, 5, 6], 0)],
            )
            run_plan(worker, plan)
            sending, receiving = worker.get_finished({"saving"})
            assert receiving == {"loading"} and sending == {"saving"}  # vLLM frees and recomputes: none left waiting
            assert worker.get_block_ids_with_load_errors() == {0, 8, 10, 11}
            assert all(torch.equal(kv[name].view(torch.int16), t.view(torch.int16)) for name, t in before.items())
            meta = scheduler.build_connector_meta(object())
            assert meta.plan.is_empty()
        (error,) = _errors(caplog)
        assert "KvferryConnector.wait_for_save" in error.getMessage() and "injected_drift" in error.getMessage()
        assert error.exc_info is not None  # the traceback
        assert scheduler._scheduler.locks_held() == 0  # the lookup's lock was freed when it turned off
    finally:
        scheduler.shutdown()
        worker.shutdown()

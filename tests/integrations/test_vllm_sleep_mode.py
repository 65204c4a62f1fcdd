"""vLLM's sleep mode through the connector (vLLM 0.32's config and KV cache objects, CPU tensors in vLLM's CPU
layout): register, store, ``unregister_kv_caches`` (lookups miss), the KV memory freed and mapped again elsewhere
(the tensors vLLM holds point at new memory, as after its wake-up), ``restore_kv_caches``, load: the stored KV
arrives bit-exact in the new memory, and nothing is written to the old. Embedded mode and server mode."""

from __future__ import annotations

import importlib.util
import uuid
from collections.abc import Iterator
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


CHUNK = 32  # two blocks


@pytest.fixture(params=["embedded", "server"])
def extra(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    if request.param == "embedded":
        yield {"mode": "embedded", "config": {"cache": {"chunk_size": CHUNK, "l1_size_gb": 0.05}}}
        return
    from tests.server.serverkit import ServerProcess

    server = ServerProcess("--chunk-size", str(CHUNK), "--l1-size-gb", "0.05")
    try:
        yield {"mode": "server", "server_url": server.endpoint, "timeout_s": 10.0}
    finally:
        server.stop()


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
        ),
    ],
)
def test_store_sleep_move_the_kv_wake_load_bit_exact(extra: dict[str, Any], device: str) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvferry.connector.plan import LoadSpec, StepPlan, StoreSpec

    engine_id, isa = uuid.uuid4().hex, "vec" if device == "cpu" else None
    worker = connector(KVConnectorRole.WORKER, extra, engine_id, isa)
    scheduler = connector(KVConnectorRole.SCHEDULER, extra, engine_id, isa)
    gen = torch.Generator().manual_seed(11)
    shape = (LAYERS, BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE)  # one buffer, a [B, H, N, C] view per layer (LBHNC)
    buffer = torch.randn(shape, generator=gen).bfloat16().to(device)
    kv = {f"model.layers.{i}.self_attn.attn": buffer[i] for i in range(LAYERS)}
    tokens = torch.randint(0, 50_000, (2 * CHUNK,), generator=gen).tolist()
    stored_blocks = [3, 7, 1, 9]
    try:
        worker.register_kv_caches(kv)
        expected = [t[stored_blocks].clone() for t in kv.values()]
        run_plan(worker, StepPlan(stores=[StoreSpec("stored", tokens, stored_blocks, 0)]))
        wait_for(lambda: worker.get_finished({"stored"})[0] == {"stored"}, what="the store")  # vLLM finished it
        assert scheduler.get_num_new_matched_tokens(request([*tokens, 5]), 0) == (2 * CHUNK, True)

        worker.unregister_kv_caches()
        assert scheduler.get_num_new_matched_tokens(request([*tokens, 6]), 0) == (0, False)  # asleep: a miss
        old = buffer.untyped_storage()
        moved = torch.full(shape, float("nan"), dtype=buffer.dtype, device=device)
        for t in kv.values():  # vLLM's tensors now in new memory (at other addresses), holding other bytes
            t.set_(moved.untyped_storage(), t.storage_offset(), t.shape, t.stride())
        assert all(t.untyped_storage().data_ptr() == moved.data_ptr() != old.data_ptr() for t in kv.values())
        old_bytes = bytes(old.cpu())

        worker.restore_kv_caches()
        loaded_blocks = [10, 2, 5, 0]
        run_plan(worker, StepPlan(loads=[LoadSpec("loaded", tokens, loaded_blocks, 0)]))
        assert worker.get_block_ids_with_load_errors() == set()
        for t, want in zip(kv.values(), expected, strict=True):
            assert torch.equal(t[loaded_blocks].view(torch.int16), want.view(torch.int16))  # bit-exact
            others = [b for b in range(BLOCKS) if b not in loaded_blocks]
            assert torch.isnan(t[others].float()).all()  # only the loaded blocks were written
        if device == "cuda":
            torch.cuda.synchronize()
        assert bytes(old.cpu()) == old_bytes  # nothing reached the old memory
        assert scheduler.get_num_new_matched_tokens(request([*tokens, 7]), 0) == (2 * CHUNK, True)
    finally:
        scheduler.shutdown()
        worker.shutdown()

"""vLLM's sleep mode through the connector (vLLM 0.32's config and KV cache objects, CPU tensors in vLLM's CPU
layout): register, store, ``unregister_kv_caches`` (lookups miss), the KV memory freed and mapped again elsewhere
(the tensors vLLM holds point at new memory, as after its wake-up), ``restore_kv_caches``, load: the stored KV
arrives bit-exact in the new memory, and nothing is written to the old. Embedded mode and server mode."""

from __future__ import annotations

import importlib.util
import time
import uuid
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm extra"),
]

LAYERS, BLOCKS, HEADS, HEAD_SIZE, BLOCK = 2, 12, 2, 64, 16
CHUNK = 32  # two blocks


def _connector(role: Any, extra: dict[str, Any], engine_id: str, isa: str | None) -> Any:
    """The connector as vLLM makes it: its CPU backend (``isa``: the attention ISA) or a GPU backend's page views
    (None)."""
    from vllm.config import KVTransferConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvferry.integrations.vllm.connector import KvferryConnector

    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    transfer = KVTransferConfig(
        kv_connector="KvferryConnector", kv_role="kv_both", engine_id=engine_id, kv_connector_extra_config=extra
    )
    vllm_config = SimpleNamespace(
        kv_transfer_config=transfer,
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1),
        cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="auto", prefix_cache_retention_interval=None),
        compilation_config=SimpleNamespace(static_forward_context={n: SimpleNamespace(isa=isa) for n in names}),
        model_config=SimpleNamespace(use_mla=False, served_model_name="sleepy", model="sleepy"),
    )
    spec = FullAttentionSpec(BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(BLOCKS, [], [KVCacheGroupSpec(names, spec)])
    return KvferryConnector(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]


def _run(worker: Any, plan: Any) -> None:
    from kvferry.integrations.vllm.connector_metadata import KvferryConnectorMetadata

    worker.bind_connector_metadata(KvferryConnectorMetadata(plan))
    worker.start_load_kv(None)
    worker.wait_for_save()
    worker.clear_connector_metadata()


def wait_for(condition: Callable[[], bool], *, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not finish in {timeout_s} s"
        time.sleep(0.01)


def _request(tokens: list[int]) -> Any:
    return SimpleNamespace(
        request_id="looked-up", prompt_token_ids=tokens, num_tokens=len(tokens), mm_features=None,
        lora_request=None, cache_salt=None,
    )  # fmt: skip


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

    from kvferry.integrations.vllm.plan import LoadSpec, StepPlan, StoreSpec

    engine_id, isa = uuid.uuid4().hex, "vec" if device == "cpu" else None
    worker = _connector(KVConnectorRole.WORKER, extra, engine_id, isa)
    scheduler = _connector(KVConnectorRole.SCHEDULER, extra, engine_id, isa)
    gen = torch.Generator().manual_seed(11)
    shape = (LAYERS, BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE)  # one buffer, a [B, H, N, C] view per layer (LBHNC)
    buffer = torch.randn(shape, generator=gen).bfloat16().to(device)
    kv = {f"model.layers.{i}.self_attn.attn": buffer[i] for i in range(LAYERS)}
    tokens = torch.randint(0, 50_000, (2 * CHUNK,), generator=gen).tolist()
    stored_blocks = [3, 7, 1, 9]
    try:
        worker.register_kv_caches(kv)
        expected = [t[stored_blocks].clone() for t in kv.values()]
        _run(worker, StepPlan(stores=[StoreSpec("stored", tokens, stored_blocks, 0)]))
        wait_for(lambda: worker.get_finished({"stored"})[0] == {"stored"}, what="the store")  # vLLM finished it
        assert scheduler.get_num_new_matched_tokens(_request([*tokens, 5]), 0) == (2 * CHUNK, True)

        worker.unregister_kv_caches()
        assert scheduler.get_num_new_matched_tokens(_request([*tokens, 6]), 0) == (0, False)  # asleep: a miss
        old = buffer.untyped_storage()
        moved = torch.full(shape, float("nan"), dtype=buffer.dtype, device=device)
        for t in kv.values():  # vLLM's tensors now in new memory (at other addresses), holding other bytes
            t.set_(moved.untyped_storage(), t.storage_offset(), t.shape, t.stride())
        assert all(t.untyped_storage().data_ptr() == moved.data_ptr() != old.data_ptr() for t in kv.values())
        old_bytes = bytes(old.cpu())

        worker.restore_kv_caches()
        loaded_blocks = [10, 2, 5, 0]
        _run(worker, StepPlan(loads=[LoadSpec("loaded", tokens, loaded_blocks, 0)]))
        assert worker.get_block_ids_with_load_errors() == set()
        for t, want in zip(kv.values(), expected, strict=True):
            assert torch.equal(t[loaded_blocks].view(torch.int16), want.view(torch.int16))  # bit-exact
            others = [b for b in range(BLOCKS) if b not in loaded_blocks]
            assert torch.isnan(t[others].float()).all()  # only the loaded blocks were written
        if device == "cuda":
            torch.cuda.synchronize()
        assert bytes(old.cpu()) == old_bytes  # nothing reached the old memory
        assert scheduler.get_num_new_matched_tokens(_request([*tokens, 7]), 0) == (2 * CHUNK, True)
    finally:
        scheduler.shutdown()
        worker.shutdown()

"""`KvferryConnector` as vLLM 0.32 makes it (its KVTransferConfig and KVCacheConfig; the rest of vLLM's config as
the fields the connector reads), for tests that call its hooks without an engine: one full-attention group of
``LAYERS`` layers, ``BLOCKS`` blocks of ``BLOCK`` tokens, ``HEADS`` KV heads of ``HEAD_SIZE``, bf16."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

LAYERS, BLOCKS, HEADS, HEAD_SIZE, BLOCK = 2, 12, 2, 64, 16


def connector(
    role: Any, extra: dict[str, Any], engine_id: str, isa: str | None = "vec", cache_dtype: str = "auto"
) -> Any:
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
        cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype=cache_dtype, prefix_cache_retention_interval=None),
        compilation_config=SimpleNamespace(static_forward_context={n: SimpleNamespace(isa=isa) for n in names}),
        model_config=SimpleNamespace(use_mla=False, served_model_name="sleepy", model="sleepy"),
    )
    spec = FullAttentionSpec(BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(BLOCKS, [], [KVCacheGroupSpec(names, spec)])
    return KvferryConnector(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]


def run_plan(worker: Any, plan: Any) -> None:
    """One step of ``plan`` on the worker's connector: loads, then (after the forward pass) stores."""
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


def request(tokens: list[int], req_id: str = "looked-up") -> Any:
    """A waiting vLLM request as the scheduler's connector reads it."""
    return SimpleNamespace(
        request_id=req_id, prompt_token_ids=tokens, num_tokens=len(tokens), mm_features=None,
        lora_request=None, cache_salt=None,
    )  # fmt: skip

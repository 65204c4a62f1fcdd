"""Test-only hooks the vLLM driver plugs into the connector (``after_load_hook``, failing loads), importable by
module path."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import torch

CORRUPT = {"on": False, "calls": 0}


def corrupt_loaded_kv(kv_layers: list[torch.Tensor], block_ids: list[int]) -> None:
    """While ``CORRUPT["on"]``, overwrite every block just loaded with random values of the same spread (the
    negative control: a load that delivers wrong KV must change the generated tokens)."""
    if not CORRUPT["on"] or not block_ids:
        return
    CORRUPT["calls"] += 1
    index = torch.tensor(block_ids)
    generator = torch.Generator().manual_seed(1234)
    for layer in kv_layers:
        blocks = layer[index]
        noise = torch.randn(blocks.shape, generator=generator) * blocks.float().std()
        layer[index] = noise.to(layer.dtype)


@contextlib.contextmanager
def failing_loads(llm: Any) -> Iterator[None]:
    """Every kvferry load of ``llm``'s engine fails (as a tier error would) while inside."""
    from kvferry.connector import backends

    backend = backends.find(llm.llm_engine.vllm_config.kv_transfer_config.engine_id)

    def fail(*args: Any, **kwargs: Any) -> Future[int]:
        failed: Future[int] = Future()
        failed.set_exception(OSError("injected tier error"))
        return failed

    backend.retrieve_async = fail
    try:
        yield
    finally:
        del backend.retrieve_async  # the class's method again

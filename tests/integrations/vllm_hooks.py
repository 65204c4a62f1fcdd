"""Test-only hooks the vLLM driver plugs into the connector (``after_load_hook``), importable by module path."""

from __future__ import annotations

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

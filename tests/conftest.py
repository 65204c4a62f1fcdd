"""Shared test helpers: random engine KV in any layout, poisoned objects, leaf access."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvferry.formats import EngineKVFormat

POISON = 0x5A  # a byte pattern no random fill is likely to leave in place everywhere


def leaves(paged: Any) -> list[torch.Tensor]:
    return [paged] if isinstance(paged, torch.Tensor) else [t for child in paged for t in leaves(child)]


def engine_bytes(paged: Any) -> list[torch.Tensor]:
    """Every byte the engine owns, padding included (via the underlying storage span of each leaf)."""
    out = []
    for t in leaves(paged):
        span = t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
        out.append(span.view(torch.uint8).clone())
    return out


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    t.view(torch.uint8).fill_(POISON)
    return t


def kv_dtype_for(fmt: EngineKVFormat, dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if fmt == EngineKVFormat.NL_X_NB_BSV_BSS else dtype


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU tests skip cleanly without CUDA, so CI (CPU-only) stays green."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

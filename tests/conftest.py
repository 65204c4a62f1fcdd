"""Shared test helpers: random engine KV in any layout, poisoned objects, leaf access."""

from __future__ import annotations

import logging
import math
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch

from kvferry.formats import EngineKVFormat, layout_of
from kvferry.formats.synthetic import ModelDims
from kvferry.transfer import block_ids

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
    """`dtype`, or one the layout holds where it takes only some element sizes (the indexer's bytes, AMX tiles)."""
    sizes = layout_of(fmt).element_sizes
    if sizes is None or dtype.itemsize in sizes:
        return dtype
    return {1: torch.uint8, 2: torch.bfloat16}[sizes[-1]]


def tile_scale(fmt: EngineKVFormat, bs: int) -> int:
    """By how much a test's block size (and with it its token counts) must grow for `fmt`: layouts that pack
    tokens in tiles need the block size to be a multiple of the tile (vLLM's AMX layout: 16)."""
    multiple = layout_of(fmt).tail_multiple("BS")
    return math.lcm(bs, multiple) // bs


def dims_for(fmt: EngineKVFormat, dims: ModelDims) -> ModelDims:
    """`dims` with the head size rounded up to the layout's head-size tile (vLLM's AMX layout: 16)."""
    multiple = layout_of(fmt).tail_multiple("HS")
    return replace(dims, hs=-(-dims.hs // multiple) * multiple)


@pytest.fixture(autouse=True)
def kvferry_records_where_pytest_captures_them(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A connector built in a test's process leaves the "kvferry" logger alone. In an engine it sends the logger's
    records to vLLM's handlers only (`show_in_vllm_log`: propagation off), which would hide them from pytest's
    capture in that test and every later one of the process (end-to-end tests run vLLM in processes of their own,
    where it does). The logger is put back as the test found it besides."""
    from kvferry.integrations.vllm import logs

    monkeypatch.setattr(logs, "show_in_vllm_log", lambda: None)
    ours = logging.getLogger("kvferry")
    handlers, level, propagate = list(ours.handlers), ours.level, ours.propagate
    yield
    ours.handlers[:], ours.propagate = handlers, propagate
    ours.setLevel(level)


@pytest.fixture(autouse=True)
def gpu_memory_given_back(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a GPU test, the memory its process's caching allocator keeps goes back to the driver: the GPU tests
    run in several workers, each starting servers and engines in processes of their own, and memory a worker only
    keeps cached made another's allocation fail on an 80 GB card (three tests out of memory in one run)."""
    yield
    if "gpu" in request.keywords and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@pytest.fixture
def block_id_checks(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Every call of `check_block_ids` in this process from now on, as its ``distinct`` flag (True: a retrieve's):
    the one function is wrapped in every kvferry module that imported it, so a new caller is counted too."""
    calls: list[bool] = []
    original = block_ids.check_block_ids

    def counted(*args: Any, **kwargs: Any) -> block_ids.CheckedBlockIds:
        calls.append(kwargs["distinct"])
        return original(*args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith("kvferry") and getattr(module, "check_block_ids", None) is original:
            monkeypatch.setattr(module, "check_block_ids", counted)
    return calls


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Soak tests run only when a -m expression names them; GPU tests skip cleanly without CUDA, so CI (CPU-only)
    stays green. The files with the most slow tests (engine starts) come first: xdist's workers take whole files in
    this order (`.ci/run`), so the longest are not left to one worker at the end while the other idles."""
    if "soak" not in (config.option.markexpr or ""):  # not by addopts' -m: a user's own -m would replace it
        soaks = [item for item in items if "soak" in item.keywords]
        if soaks:
            config.hook.pytest_deselected(items=soaks)
            items[:] = [item for item in items if "soak" not in item.keywords]
    slow = Counter(item.path for item in items if "slow" in item.keywords)
    items.sort(key=lambda item: -slow[item.path])  # stable: each file's own order kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

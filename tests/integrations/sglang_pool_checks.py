"""SGLang's device KV pools built by SGLang's own classes, against what ``data/sglang_pools.json`` recorded of them
(`kvferry.bench.sglang_pools`): the file cannot drift from SGLang, and a pool replayed from it is, to kvferry's
view of it, the pool SGLang builds.

Run by `test_sglang_release` in a child pytest with a released SGLang's Python first on the path. Run as a script
in the same setting to rewrite the fixtures (``PYTHONPATH=.sglang-releases/0.5.23:src:.
python tests/integrations/sglang_pool_checks.py``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from tests.integrations import sglang_standin

sglang_standin.install()

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402

from kvferry.bench.sglang_pools import BENCH_CASES, CASES, FIXTURES, Case, case_of, load_fixtures, record  # noqa: E402
from kvferry.bench.sglang_pools import replay as replay_pool  # noqa: E402
from kvferry.integrations.sglang.device_pages import device_kv  # noqa: E402


def build(case: Case) -> Any:
    """``case``'s pool as an SGLang worker builds it (on the CPU: the allocation code is the device's)."""
    dtype, last = getattr(torch, case.dtype), case.layers - 1
    if case.kind == "mha":
        return MHATokenToKVPool(
            case.tokens, case.page_size, dtype, case.kv_heads, case.head_dim, case.layers, "cpu", False,
            start_layer=0, end_layer=last,
        )  # fmt: skip
    return MLATokenToKVPool(
        case.tokens, case.page_size, dtype, case.kv_lora_rank, case.rope_dim, case.layers, "cpu", False,
        start_layer=0, end_layer=last,
    )  # fmt: skip


RECORDED = load_fixtures() if FIXTURES.exists() else []  # absent only while the script writes it


@pytest.mark.parametrize("case", CASES + BENCH_CASES, ids=lambda c: c.name)
def test_the_recorded_pool_is_the_one_sglang_builds(case: Case) -> None:
    fixture = next((f for f in RECORDED if case_of(f) == case), None)
    assert fixture is not None, f"{case.name} is not in {FIXTURES.name}: rewrite it (see this file's docstring)"
    pool = build(case)
    assert record(case, pool) == fixture
    if case.kind == "mha":  # SGLang 0.5.23: a layer's K and V are the halves of one allocation
        assert len(fixture["storage_bytes"]) == case.layers


@pytest.mark.parametrize("fixture", RECORDED, ids=lambda f: case_of(f).name)
def test_a_replayed_pool_is_the_same_pool_to_kvferry(fixture: dict[str, Any]) -> None:
    real, replayed = device_kv(build(case_of(fixture))), device_kv(replay_pool(fixture, "cpu"))
    assert (replayed.fmt, replayed.block_size, replayed.kv_dtype, replayed.layer_names) == (
        real.fmt, real.block_size, real.kv_dtype, real.layer_names,
    )  # fmt: skip
    assert _placement(replayed.paged) == _placement(real.paged)


def _placement(paged: Any) -> list[tuple[Any, ...]]:
    """Each tensor kvferry copies: shape, strides, dtype, and where it starts in its allocation."""
    tensors = [t for part in paged for t in (part if isinstance(part, list) else [part])]
    return [(t.shape, t.stride(), t.dtype, t.data_ptr() - t.untyped_storage().data_ptr()) for t in tensors]


if __name__ == "__main__":
    fixtures = [record(case, build(case)) for case in CASES + BENCH_CASES]
    FIXTURES.parent.mkdir(exist_ok=True)
    FIXTURES.write_text(json.dumps(fixtures, indent=1) + "\n")
    print(f"{len(fixtures)} cases written to {FIXTURES}")

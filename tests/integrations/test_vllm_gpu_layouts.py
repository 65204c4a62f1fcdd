"""vLLM's GPU KV caches, as vLLM's own code builds them, through the connector's worker side (on CPU tensors).

Every case of `page_view_cases` (each GPU attention backend of vLLM 0.32 that imports here, each layout it accepts,
bf16 / fp16 / fp8, MHA and MLA, kernel blocks smaller than the scheduler's, tensor-parallel ranks) is replayed from
the recorded fixtures, which `test_fixtures_are_what_vllm_builds` checks against vLLM itself. The GPU machine replays
the same fixtures on CUDA (tests/integrations/test_vllm_gpu_connector.py).
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from kvferry.formats import EngineKVFormat
from kvferry.integrations.vllm.backends import KeySpace, make_worker_backend
from kvferry.integrations.vllm.kv_layout import EngineKV, recognise
from kvferry.integrations.vllm.plan import LoadSpec, StepPlan, StoreSpec
from kvferry.integrations.vllm.settings import ConnectorSettings
from kvferry.integrations.vllm.worker_side import WorkerSide
from tests.integrations.page_view_cases import Case, case_of, load_fixtures, record, replay

FIXTURES = load_fixtures()
F = EngineKVFormat
EXPECTED = {
    "LBHNC": F.NL_X_NB_NH_BS_CS,
    "LHBNC": F.NL_X_NB_NH_BS_CS,
    "LBNHC": F.NL_X_NB_BS_NH_CS,
    "BLHNC": F.NB_NL_NH_BS_CS,
    "BHLNC": F.NB_NL_NH_BS_CS,
    "BLNHC": F.NB_NL_BS_NH_CS,
}


def ids(fixture: dict) -> str:
    return case_of(fixture).name


def recognised(case: Case, views: dict[str, torch.Tensor]) -> EngineKV:
    return recognise(
        views,
        isa=None,
        kv_cache_dtype=case.cache_dtype,
        tp=case.tp,
        model_kv_heads=case.model_kv_heads,
        mla=case.mla,
        block_size=case.block_size,
    )


def test_fixtures_are_what_vllm_builds() -> None:
    pytest.importorskip("vllm")
    from tests.integrations.vllm_page_views import all_cases, build

    built = [record(case, *build(case)) for case in all_cases()]
    assert json.loads(json.dumps(built)) == FIXTURES  # as written to the file (tuples become lists)
    backends = {case_of(f).backend for f in FIXTURES}
    assert backends == {"FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "FLASHMLA", "TRITON_MLA"}


@pytest.mark.parametrize("fixture", FIXTURES, ids=ids)
def test_every_layout_is_recognised_from_its_strides(fixture: dict) -> None:
    case = case_of(fixture)
    _, views = replay(fixture, "cpu")
    kv = recognised(case, views)
    assert kv.fmt is (F.NL_X_NB_BS_HS if case.mla else EXPECTED[case.layout])
    assert kv.order == case.layout
    assert kv.kv_dtype == (case.dtype if case.dtype.startswith("fp8") else str(case.model_dtype).split(".")[1])
    assert kv.block_size * kv.split == case.block_size
    assert kv.layers == list(views.values())
    if case.tp[1] > 1:
        assert kv.heads == (case.tp[0] * case.kv_heads, case.model_kv_heads)


def _worker(case: Case, views: dict[str, torch.Tensor], settings: ConnectorSettings) -> tuple[EngineKV, WorkerSide]:
    kv = recognised(case, views)
    backend = make_worker_backend(settings, kv, model=case.name, block_size=case.block_size, name="test")
    return kv, WorkerSide(backend, block_size=case.block_size)


def _settings(case: Case) -> ConnectorSettings:
    config = {"cache": {"chunk_size": 2 * case.block_size, "l1_size_gb": 0.02}, "tiers": []}
    return ConnectorSettings(mode="embedded", config=config)


def _gathered(kv: EngineKV, block_ids: list[int]) -> list[torch.Tensor]:
    """A plain torch gather of every layer's blocks (kernel blocks of the scheduler's ``block_ids``)."""
    index = torch.as_tensor(list(kv.kernel_block_ids(block_ids)))
    return [layer.index_select(0, index) for layer in kv.layers]


@pytest.mark.parametrize("fixture", [f for f in FIXTURES if case_of(f).tp[1] == 1], ids=ids)
def test_a_store_then_a_load_into_a_second_cache_is_bit_exact(fixture: dict) -> None:
    case = case_of(fixture)
    rng = random.Random(case.name)
    blocks = case.num_blocks
    tokens = [rng.randrange(50_000) for _ in range(4 * case.block_size + 5)]  # two chunks and a partial one
    src, dst = rng.sample(range(blocks), 4), rng.sample(range(blocks), 4)
    settings = _settings(case)
    _, views_a = replay(fixture, "cpu")
    _, views_b = replay(fixture, "cpu")  # other random bytes: whatever the load does not write shows
    kv_a, worker_a = _worker(case, views_a, settings)
    kv_b = recognised(case, views_b)
    # One cache, two engines' KV: the second engine's backend shares the first one's cache engine.
    backend_b = type(worker_a._backend)(worker_a._backend.engine, kv_b, worker_a._backend.namespace)
    worker_b = WorkerSide(backend_b, block_size=case.block_size)
    try:
        worker_a.start_stores(StepPlan(stores=[StoreSpec("a", tokens, src, skip_tokens=0)]))
        worker_a.preempted(["a"])
        assert worker_a.counters.tokens_stored == 4 * case.block_size
        expected = _gathered(kv_a, src)
        before = [layer.clone() for layer in kv_b.layers]
        worker_b.start_loads(StepPlan(loads=[LoadSpec("b", tokens[: 4 * case.block_size], dst, case.block_size)]))
        assert worker_b.take_load_errors() == set()
        assert worker_b.counters.tokens_loaded == 3 * case.block_size
        for got, want in zip(_gathered(kv_b, dst[1:]), expected, strict=True):
            assert torch.equal(got.view(torch.uint8), want[kv_a.split :].view(torch.uint8))
        untouched = [b for b in range(blocks) if b not in dst[1:]]
        for got, old in zip(_gathered(kv_b, untouched), [b.clone() for b in before], strict=True):
            assert torch.equal(got.view(torch.uint8), old.index_select(0, _index(kv_b, untouched)).view(torch.uint8))
    finally:
        worker_a.close()
        worker_b.close()
        worker_a._backend.close()


def _index(kv: EngineKV, block_ids: list[int]) -> torch.Tensor:
    return torch.as_tensor(list(kv.kernel_block_ids(block_ids)))


@pytest.mark.parametrize("layout", sorted(EXPECTED))
def test_tensor_parallel_ranks_share_one_key_space_and_fill_each_others_objects(layout: str) -> None:
    ranks = [f for f in FIXTURES if case_of(f).tp[1] == 2 and case_of(f).layout == layout]
    assert len(ranks) == 2
    cases = [case_of(f) for f in ranks]
    kvs = [recognised(c, replay(f, "cpu")[1]) for c, f in zip(cases, ranks, strict=True)]
    spaces = {KeySpace.of(kv, model="m", salt="") for kv in kvs}
    assert len(spaces) == 1 and spaces.pop().width == 4 * 2 * cases[0].head_size  # every head's columns


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "TRITON_MLA"])
def test_engines_of_different_layouts_share_objects(backend: str) -> None:
    """Every layout's objects hold the same bytes: a prefix stored from one order loads into every other."""
    group = [f for f in FIXTURES if case_of(f).backend == backend and case_of(f).dtype == "bfloat16"]
    group = [f for f in group if case_of(f).tp[1] == 1 and case_of(f).kernel_block is None]
    sizes = [case_of(f).block_size for f in group]
    block_size = max(set(sizes), key=sizes.count)  # MLA's layer-compact cases use larger blocks (split ones)
    group = [f for f in group if case_of(f).block_size == block_size]
    base = case_of(group[0])
    assert len(group) >= 4
    rng = random.Random(backend)
    tokens = [rng.randrange(50_000) for _ in range(4 * base.block_size)]
    settings = _settings(base)
    kvs = [recognised(case_of(f), replay(f, "cpu")[1]) for f in group]
    first = make_worker_backend(settings, kvs[0], model="shared", block_size=base.block_size, name="test")
    try:
        src = rng.sample(range(base.num_blocks), 4)
        WorkerSide(first, block_size=base.block_size).start_stores(StepPlan(stores=[StoreSpec("a", tokens, src, 0)]))
        stored = [layer.index_select(0, _index(kvs[0], src)) for layer in kvs[0].layers]
        first.engine.close()  # waits for the store
        for kv in kvs[1:]:
            namespace = first.engine.namespace_for("shared", kv.fmt, kv.paged, block_size=kv.block_size)
            assert namespace == first.namespace
            dst = rng.sample(range(base.num_blocks), 4)
            got = first.engine.retrieve(tokens, kv.paged, kv.kernel_block_ids(dst), kv.fmt, namespace=namespace)
            assert got == len(tokens)
            for layer, want in zip(kv.layers, stored, strict=True):
                assert torch.equal(layer.index_select(0, _index(kv, dst)).view(torch.uint8), want.view(torch.uint8))
    finally:
        first.close()

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

from kvferry.bench.vllm_views import BENCH_CASES, case_of, load_fixtures, record, replay
from kvferry.cache import CacheEngine, CacheNamespace
from kvferry.config import KvferryConfig
from kvferry.connector.backends import EmbeddedBackend, KeySpace
from kvferry.connector.engine_kv import EngineKV
from kvferry.connector.plan import StepPlan, StoreSpec
from kvferry.connector.worker_backend import make_worker_backend
from kvferry.connector.worker_side import WorkerSide
from kvferry.formats import EngineKVFormat, describe
from tests.integrations.page_view_roundtrip import (
    check_roundtrip,
    embedded_settings,
    gathered,
    kernel_index,
    recognised,
)

RECORDED = load_fixtures()
FIXTURES = [f for f in RECORDED if case_of(f) not in BENCH_CASES]  # the model-sized ones are the benchmark's
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


def test_fixtures_are_what_vllm_builds() -> None:
    pytest.importorskip("vllm")
    from tests.integrations.vllm_page_views import all_cases, build

    built = [record(case, *build(case)) for case in all_cases()]
    assert json.loads(json.dumps(built)) == RECORDED  # as written to the file (tuples become lists)
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


@pytest.mark.parametrize("fixture", [f for f in FIXTURES if case_of(f).tp[1] == 1], ids=ids)
def test_a_store_then_a_load_into_a_second_cache_is_bit_exact(fixture: dict) -> None:
    check_roundtrip(fixture, "cpu")


@pytest.mark.parametrize("layout", sorted(EXPECTED))
def test_tensor_parallel_ranks_share_one_key_space_and_fill_each_others_objects(layout: str) -> None:
    """Two ranks' halves of the heads make one object (a hit once both are written); each loads its own half."""
    ranks = [f for f in FIXTURES if case_of(f).tp[1] == 2 and case_of(f).layout == layout]
    cases = [case_of(f) for f in ranks]
    assert [c.tp for c in cases] == [(0, 2), (1, 2)]
    sources = [recognised(c, replay(f, "cpu")[1]) for c, f in zip(cases, ranks, strict=True)]
    targets = [recognised(c, replay(f, "cpu")[1]) for c, f in zip(cases, ranks, strict=True)]
    spaces = {KeySpace.of(kv, model="m", salt="") for kv in sources}
    assert len(spaces) == 1 and spaces.pop().width == 4 * 2 * cases[0].head_size  # every head's columns
    bs = cases[0].block_size
    engine = CacheEngine(KvferryConfig.load(env={}, overrides=embedded_settings(cases[0]).config))
    try:
        backends = [EmbeddedBackend(engine, kv, _namespace(engine, kv)) for kv in [*sources, *targets]]
        assert len({b.namespace for b in backends}) == 1
        tokens = list(range(100, 100 + 4 * bs))
        src, dst = [3, 0, 7, 5], [1, 9, 2, 11]
        for rank, backend in enumerate(backends[:2]):
            assert backend.store_async(tokens, src, 0).result() == 4 * bs
            hit = backend.lookup(tokens)
            assert hit.tokens == 4 * bs * rank  # readable once every head is written
            backend.free_lock(hit.lock)
        for source, target, backend in zip(sources, targets, backends[2:], strict=True):
            assert backend.retrieve_async(tokens, dst, 0).result() == 4 * bs
            for got, want in zip(gathered(target, dst), gathered(source, src), strict=True):
                assert torch.equal(got, want)
    finally:
        engine.close()


def _namespace(engine: CacheEngine, kv: EngineKV) -> CacheNamespace:
    geometry = describe(kv.fmt, kv.paged, kv.block_size, heads=kv.heads)
    return engine.namespace_for("m", kv.fmt, kv.paged, geometry=geometry)


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
    settings = embedded_settings(base)
    kvs = [recognised(case_of(f), replay(f, "cpu")[1]) for f in group]
    first = make_worker_backend(settings, kvs[0], model="shared", block_size=base.block_size, name="test")
    try:
        src = rng.sample(range(base.num_blocks), 4)
        WorkerSide(first, block_size=base.block_size).start_stores(StepPlan(stores=[StoreSpec("a", tokens, src, 0)]))
        stored = [layer.index_select(0, kernel_index(kvs[0], src)) for layer in kvs[0].layers]
        first.engine.close()  # waits for the store
        for kv in kvs[1:]:
            namespace = first.engine.namespace_for("shared", kv.fmt, kv.paged, block_size=kv.block_size)
            assert namespace == first.namespace
            dst = rng.sample(range(base.num_blocks), 4)
            got = first.engine.retrieve(tokens, kv.paged, kv.kernel_block_ids(dst), kv.fmt, namespace=namespace)
            assert got == len(tokens)
            for layer, want in zip(kv.layers, stored, strict=True):
                assert torch.equal(
                    layer.index_select(0, kernel_index(kv, dst)).view(torch.uint8), want.view(torch.uint8)
                )
    finally:
        first.close()

"""The CPU copy over all storages at once (`kernels/cpu_span.py`): one call per run of objects, whatever the engine's
allocation; objects inside the address range it spans; the per-storage fallback."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import kvferry
from kvferry import Direction
from kvferry.formats import EngineKVFormat, describe
from kvferry.formats.synthetic import ModelDims, make_paged, random_fill
from kvferry.kernels import cpu_span, cpu_threads, torch_copy
from tests.conftest import engine_bytes, poisoned

F = EngineKVFormat
DIMS = ModelDims(nl=4, nh=2, hs=8)
CHUNK, BS = 8, 4


def _request(fmt: F, one_buffer: bool) -> tuple[object, list[int], tuple[int, int, int, int], torch.dtype]:
    paged = make_paged(fmt, DIMS, 12, BS, torch.bfloat16, one_buffer=one_buffer, generator=torch.Generator())
    geom = describe(fmt, paged, block_size=BS)
    return paged, [7, 2, 11, 0, 5, 9, 3, 1], geom.object_shape(CHUNK), geom.dtype


def _back_to_back(shape: tuple[int, ...], count: int, fill: bool) -> list[torch.Tensor]:
    run = torch.empty((count, *shape), dtype=torch.bfloat16)
    random_fill(run) if fill else run.view(torch.uint8).fill_(0x5A)
    return list(run.unbind(0))


@pytest.mark.parametrize("direction", [Direction.D2H, Direction.H2D])
@pytest.mark.parametrize(
    "fmt", [F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_TWO_NB_NH_BS_HS, F.VLLM_CPU_NL_X_NB_NH_KT_V], ids=lambda f: f.name
)
def test_a_tensor_per_layer_is_one_copy_per_run_of_adjacent_objects(
    monkeypatch: pytest.MonkeyPatch, fmt: F, direction: Direction
) -> None:
    """vLLM allocates a tensor per layer: still one copy job per stripe for objects that follow each other in memory
    (token-major pieces as rows; heads before tokens as whole runs permuted through a buffer), and the bytes equal
    the reference's. vLLM's CPU layout (a head's K^T beside its V) retrieves as rows and stores folded per storage.
    Jobs are counted where a server's copy threads take them."""
    paged, ids, shape, _ = _request(fmt, one_buffer=False)
    assert len({t.untyped_storage().data_ptr() for t in paged}) >= DIMS.nl
    stripes = len(describe(fmt, paged, block_size=BS).stripes)
    jobs: list[str] = []
    run_jobs = cpu_threads.run

    def counted_run(batch):  # type: ignore[no-untyped-def]
        jobs.extend(type(job).__name__ for job in batch)
        return run_jobs(batch)

    monkeypatch.setattr(cpu_threads, "_own_threads", 2)
    monkeypatch.setattr(cpu_threads, "run", counted_run)
    fill = direction is Direction.H2D
    got, want = _back_to_back(shape, 4, fill), _back_to_back(shape, 4, fill)
    if fill:
        for a, b in zip(got, want, strict=True):
            b.copy_(a)
        target = make_paged(fmt, DIMS, 12, BS, torch.bfloat16, one_buffer=False, generator=torch.Generator())
        reference = [t.clone() for t in target]
        kvferry.transfer(target, got, ids, direction, fmt, CHUNK, backend="torch", block_size=BS)
        kvferry.transfer(reference, want, ids, direction, fmt, CHUNK, backend="reference", block_size=BS)
        assert all(torch.equal(a, b) for a, b in zip(engine_bytes(target), engine_bytes(reference), strict=True))
    else:
        kvferry.transfer(paged, got, ids, direction, fmt, CHUNK, backend="torch", block_size=BS)
        kvferry.transfer(paged, want, ids, direction, fmt, CHUNK, backend="reference", block_size=BS)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want, strict=True))
    expected = {
        F.NL_X_TWO_NB_BS_NH_HS: ["Scatter" if fill else "Gather"] * stripes,
        F.NL_X_TWO_NB_NH_BS_HS: ["_Permuted"] * stripes,
        F.VLLM_CPU_NL_X_NB_NH_KT_V: ["Scatter"] * stripes if fill else [],
    }
    assert jobs == expected[fmt]


@pytest.mark.parametrize("direction", [Direction.D2H, Direction.H2D])
def test_objects_inside_the_spanned_range(direction: Direction) -> None:
    """Objects that lie between two of the engine's layers (inside the range the span covers) move like any others,
    and no byte between the layers and objects that is not a block piece or an object is written."""
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    paged_like, ids, shape, _ = _request(fmt, one_buffer=False)
    layer_numel = paged_like[0].numel()
    object_numel = shape[0] * shape[1] * shape[2] * shape[3]
    gap = 13  # elements of foreign memory around every tensor
    arena = torch.empty(DIMS.nl * (layer_numel + gap) + 4 * (object_numel + gap), dtype=torch.bfloat16)
    arena.view(torch.uint8).fill_(0x3C)
    layers, objects, at = [], [], 0
    for i in range(DIMS.nl):  # layer, two objects, layer, two objects, ...
        layers.append(arena[at : at + layer_numel].view(paged_like[0].shape))
        at += layer_numel + gap
        for _ in range(2 if i < 2 else 0):
            objects.append(arena[at : at + object_numel].view(shape))
            at += object_numel + gap
    for layer, source in zip(layers, paged_like, strict=True):
        layer.copy_(source)
    if direction is Direction.H2D:
        for obj in objects:
            random_fill(obj)
    foreign = torch.ones(arena.numel(), dtype=torch.bool)
    for t in (*layers, *objects):
        start = t.data_ptr() - arena.data_ptr()
        foreign[start // 2 : start // 2 + t.numel()] = False
    before = arena.view(torch.int16).clone()
    reference_engine = [t.clone() for t in layers]
    reference_objects = [o.clone() if direction is Direction.H2D else poisoned(shape, o.dtype) for o in objects]
    kvferry.transfer(layers, objects, ids, direction, fmt, CHUNK, backend="torch", block_size=BS)
    kvferry.transfer(
        reference_engine, reference_objects, ids, direction, fmt, CHUNK, backend="reference", block_size=BS
    )
    after = arena.view(torch.int16)
    assert torch.equal(after[foreign], before[foreign])
    assert all(torch.equal(a, b) for a, b in zip(layers, reference_engine, strict=True))
    if direction is Direction.D2H:
        for a, b in zip(objects, reference_objects, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("fmt", [F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_TWO_NB_NH_BS_HS, F.NL_X_NB_BS_HS], ids=lambda f: f.name)
def test_without_a_span_the_per_storage_copy_matches_the_reference(monkeypatch: pytest.MonkeyPatch, fmt: F) -> None:
    """Where a geometry cannot be spanned (stripes that are not plane x layer grids), the torch backend folds each
    storage's entries instead: same bytes, both directions."""
    monkeypatch.setattr(torch_copy, "build_span", lambda geom: None)
    paged, ids, shape, dtype = _request(fmt, one_buffer=False)
    geom = describe(fmt, paged, block_size=BS)
    assert torch_copy.build_plan(geom).span is None and torch_copy.build_plan(geom).blocks
    got, want = ([poisoned(shape, dtype) for _ in range(4)] for _ in range(2))
    kvferry.transfer(paged, got, ids, Direction.D2H, fmt, CHUNK, 1, backend="torch", geometry=geom)
    kvferry.transfer(paged, want, ids, Direction.D2H, fmt, CHUNK, 1, backend="reference", block_size=BS)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want, strict=True))
    target, reference = (make_paged(fmt, DIMS, 12, BS, dtype, one_buffer=False) for _ in range(2))
    for a, b in zip(target, reference, strict=True):
        b.copy_(a)
    sources = [random_fill(torch.empty(shape, dtype=dtype)) for _ in range(4)]
    kvferry.transfer(target, sources, ids, Direction.H2D, fmt, CHUNK, 1, backend="torch", block_size=BS,
                     geometry=describe(fmt, target, block_size=BS))  # fmt: skip
    kvferry.transfer(reference, sources, ids, Direction.H2D, fmt, CHUNK, 1, backend="reference", block_size=BS)
    assert all(torch.equal(a, b) for a, b in zip(engine_bytes(target), engine_bytes(reference), strict=True))


@pytest.mark.parametrize("fmt", [F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_TWO_NB_NH_BS_HS], ids=lambda f: f.name)
def test_stores_on_own_threads_match_the_reference(monkeypatch: pytest.MonkeyPatch, fmt: F) -> None:
    """In a process that runs its copies on kvferry's threads (the server), a store's gathers are cut into spans
    across them: same bytes. (The threshold is lowered: test tensors are far below the size that engages threads.)"""
    monkeypatch.setattr(cpu_threads, "_own_threads", 3)
    monkeypatch.setattr(cpu_threads, "_MIN_PART_BYTES", 1)
    spans: list[int] = []
    for job in (cpu_threads.Gather, cpu_span._Permuted):
        split = job.split
        monkeypatch.setattr(job, "split", lambda self, parts, split=split: spans.append(parts) or split(self, parts))
    paged, ids, shape, dtype = _request(fmt, one_buffer=False)
    got, want = _back_to_back(shape, 4, fill=False), [poisoned(shape, dtype) for _ in range(4)]
    kvferry.transfer(paged, got, ids, Direction.D2H, fmt, CHUNK, 1, backend="torch", block_size=BS)
    kvferry.transfer(paged, want, ids, Direction.D2H, fmt, CHUNK, 1, backend="reference", block_size=BS)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want, strict=True))
    assert spans  # the run of three whole objects (and the partial first one) went to the threads in spans


def test_own_threads_need_one() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        cpu_threads.use_own_threads(0)


class _Job:
    """A copy job that says which thread ran it. On the caller's thread it sets `caller_ran` (and raises with
    `fail`); on a copy thread it first waits for that, so the caller surely takes a job while helpers copy."""

    nbytes = 1

    def __init__(self, log: list[str], caller_ran: threading.Event, fail: bool = False) -> None:
        self.log, self.caller_ran, self.fail = log, caller_ran, fail
        self.caller = threading.current_thread()

    def run(self) -> None:
        if threading.current_thread() is self.caller:
            self.caller_ran.set()
            if self.fail:
                raise RuntimeError("the caller's job failed")
            self.log.append("caller")
        else:
            self.caller_ran.wait(2)
            time.sleep(0.05)  # still copying after the caller is done with its job
            self.log.append("helper" if self.caller_ran.is_set() else "helper, the caller never took a job")

    def split(self, parts: int) -> list[_Job]:
        raise AssertionError("no job is split when there are more jobs than threads")


def test_copy_threads_run_every_job_once_the_caller_taking_some(monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs are shared out between the caller and the pool's threads: the caller copies instead of waiting."""
    monkeypatch.setattr(cpu_threads, "_own_threads", 3)
    monkeypatch.setattr(cpu_threads, "_MIN_PART_BYTES", 1)
    log: list[str] = []
    caller_ran = threading.Event()
    cpu_threads.run([_Job(log, caller_ran) for _ in range(8)])
    assert len(log) == 8
    assert "caller" in log
    assert set(log) <= {"caller", "helper"}


def test_a_failed_copy_job_is_raised_after_every_thread_has_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller's job fails while a copy thread still copies: run() raises only once nothing writes any more."""
    monkeypatch.setattr(cpu_threads, "_own_threads", 2)
    monkeypatch.setattr(cpu_threads, "_MIN_PART_BYTES", 1)
    log: list[str] = []
    caller_ran = threading.Event()
    with pytest.raises(RuntimeError, match="the caller's job failed"):
        cpu_threads.run([_Job(log, caller_ran, fail=True) for _ in range(2)])
    assert log == ["helper"]


@pytest.mark.parametrize("one_buffer", [True, False], ids=["one-buffer", "a-tensor-per-layer"])
def test_vllm_cpu_layout_stores_fold_and_retrieves_fold_only_in_one_buffer(one_buffer: bool) -> None:
    """vLLM's CPU layout (a head's K^T beside its V) stores through per-storage folds (an index over blocks copies
    every layer of a block at once); it retrieves through them too where each stripe folds into one view, and
    through the span's rows where a fold would be a call per layer."""
    fmt = F.VLLM_CPU_NL_X_NB_NH_KT_V
    paged, *_ = _request(fmt, one_buffer)
    plan = torch_copy.build_plan(describe(fmt, paged, block_size=BS))
    assert plan.span is not None
    stripes = frozenset(range(len(plan.span.entries)))
    assert plan.folded_stores == stripes
    assert plan.folded_retrieves == (stripes if one_buffer else frozenset())


@pytest.mark.parametrize("direction", [Direction.D2H, Direction.H2D])
@pytest.mark.parametrize("head_dim", [64, 8])
def test_tokens_apart_are_rows_of_their_own_where_a_token_holds_a_long_run(direction: Direction, head_dim: int) -> None:
    """SGLang's page_first host pool (``[2, tokens, layers, heads, head]``): a block's tokens lie a whole token of
    every layer apart, each token's heads one run. Runs of 256 bytes or more are copied as rows of their own, one per
    token (a block piece at once would be copied element by element); shorter ones stay in the block's piece. The
    bytes equal the reference's both ways, whatever the rows, and nothing else is written."""
    layers, heads, nb = 3, 2, 12
    buffer = torch.empty((2, nb * BS, layers, heads, head_dim), dtype=torch.bfloat16)
    random_fill(buffer)
    fmt = F.TWO_X_NL_X_NB_BS_NH_HS
    paged = [[buffer[kv, :, layer].unflatten(0, (nb, BS)) for layer in range(layers)] for kv in range(2)]
    geom = describe(fmt, paged, block_size=BS)
    plan = cpu_span.build_span(geom)
    assert plan is not None
    token_rows = head_dim * heads * 2 >= 256
    assert {e.token_stride for e in plan.entries} == {layers * heads * head_dim if token_rows else 0}
    assert torch_copy.build_plan(geom).folded_stores == (
        frozenset() if token_rows else frozenset(range(len(geom.stripes)))
    )
    ids, shape = [7, 2, 11, 0, 5, 9, 3, 1], geom.object_shape(CHUNK)
    if direction is Direction.D2H:
        got, want = (
            [poisoned(shape, torch.bfloat16) for _ in range(4)],
            [poisoned(shape, torch.bfloat16) for _ in range(4)],
        )
        kvferry.transfer(paged, got, ids, direction, fmt, CHUNK, backend="torch", block_size=BS)
        kvferry.transfer(paged, want, ids, direction, fmt, CHUNK, backend="reference", block_size=BS)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want, strict=True))
    else:
        objects = _back_to_back(shape, 4, fill=True)
        reference = buffer.clone()
        ref_paged = [[reference[kv, :, layer].unflatten(0, (nb, BS)) for layer in range(layers)] for kv in range(2)]
        kvferry.transfer(paged, objects, ids, direction, fmt, CHUNK, backend="torch", block_size=BS)
        kvferry.transfer(ref_paged, objects, ids, direction, fmt, CHUNK, backend="reference", block_size=BS)
        assert torch.equal(buffer.view(torch.uint8), reference.view(torch.uint8))

"""Mamba / linear-attention state through the connector: a state-space hybrid's KV cache as vLLM's own code lays it
out (a Mamba group whose state pages are shared with a full-attention group's, every physical order; recorded in
`vllm_hybrid_views`, checked against vLLM by the first test), states stored at chunk boundaries from the blocks
vLLM hands over and loaded into the block it allocates for a hit's state: on CPU tensors, and on a CUDA device
where there is one. Then what the scheduler half plans for such a group, and what a missing state does to a hit."""

from __future__ import annotations

import random
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvferry.bench.vllm_views import case_of, replay
from kvferry.connector.backends import EmbeddedBackend, Hit
from kvferry.connector.hybrid_worker import HybridWorker, start_hybrid_worker
from kvferry.connector.kv_groups import NULL_BLOCK, KVGroup, UnsupportedGroups
from kvferry.connector.plan import LoadSpec, StepPlan, StoreSpec
from kvferry.connector.settings import ConnectorSettings
from kvferry.connector.state_groups import StateBackend, row_bytes, state_key_tokens, state_kv
from kvferry.integrations.vllm.kv_layout import recognise
from kvferry.integrations.vllm.scheduler_side import GroupedSchedulerSide, SchedulerSide
from kvferry.integrations.vllm.vllm_groups import groups_of
from tests.integrations.vllm_hybrid_views import (
    MAMBA_CASES,
    MAMBA_FIXTURES,
    REPLAY_DEVICES,
    assert_recorded_as_vllm_builds,
    build_mamba,
    recorded,
)

FIXTURES = recorded(MAMBA_FIXTURES)
CHUNK = 64  # the fixtures' block size: one block per chunk


def test_fixtures_are_what_vllm_builds() -> None:
    assert_recorded_as_vllm_builds(FIXTURES, build_mamba, MAMBA_CASES)


def test_mamba_groups_are_read_off_vllms_specs_only_in_align_mode() -> None:
    kv_cache_interface = pytest.importorskip("vllm.v1.kv_cache_interface")
    full = kv_cache_interface.FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    shapes, dtypes = ((3, 96), (4, 16, 16)), (torch.bfloat16, torch.float32)

    def config(mode: str) -> SimpleNamespace:
        mamba = kv_cache_interface.MambaSpec(
            block_size=64, shapes=shapes, dtypes=dtypes, page_size_padded=full.page_size_bytes, mamba_cache_mode=mode
        )
        specs = [(["m0", "m2"], mamba), (["a1", "a3"], full)]
        return SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=n, kv_cache_spec=s) for n, s in specs])

    mamba, attention = groups_of(config("align"))
    assert (mamba.kind, mamba.holds_state, mamba.windowed, mamba.page_bytes) == ("mamba", True, False, 32768)
    assert mamba.tag == "group=0:mamba" and attention.kind == "full"
    with pytest.raises(UnsupportedGroups, match="mamba_cache_mode 'align'"):
        groups_of(config("none"))  # vLLM keeps no state at a boundary without its prefix caching


def test_a_state_is_rows_of_its_page_and_keyed_by_its_whole_prefix() -> None:
    assert row_bytes(4672, 32768, 64) == 80  # 73 bytes a row, up to 16: 448 bytes of the page's padding ride along
    assert row_bytes(4672, 4800, 64) == 74  # no room for wide rows: the narrowest even ones
    with pytest.raises(ValueError, match="does not fit"):
        row_bytes(4672, 4700, 64)
    prefix = list(range(128))
    key = state_key_tokens(prefix, CHUNK)
    assert len(key) == CHUNK and key == state_key_tokens(list(prefix), CHUNK)
    assert key != state_key_tokens([*prefix[:-1], 5], CHUNK) and key != state_key_tokens(prefix[:64], CHUNK)


def _groups(fixture: dict[str, Any]) -> list[KVGroup]:
    case = case_of(fixture)
    mamba, full = fixture["groups"]
    return [
        KVGroup(0, "mamba", case.block_size, tuple(mamba["layers"]), page_bytes=mamba["page_bytes"]),
        KVGroup(1, "full", case.block_size, tuple(full["layers"])),
    ]


def _worker(fixture: dict[str, Any], views: dict[str, torch.Tensor]) -> HybridWorker:
    groups = _groups(fixture)
    case = case_of(fixture)
    mamba, full = groups
    kvs = [
        state_kv([views[n] for n in mamba.layer_names], mamba.layer_names, mamba.page_bytes, CHUNK),
        recognise({n: views[n] for n in full.layer_names}, isa=None, kv_cache_dtype="auto", block_size=CHUNK),
    ]
    settings = ConnectorSettings(mode="embedded", config={"cache": {"chunk_size": CHUNK, "l1_size_gb": 0.01}})
    return start_hybrid_worker(settings, kvs, groups, model=f"mamba-{case.name}", name="test")


def _store(worker: HybridWorker, tokens: list[int], full_blocks: list[int], states: dict[int, int]) -> None:
    """Store the full group's chunks of ``tokens`` and the states at the boundaries of ``states`` (boundary ->
    the block vLLM handed over for it)."""
    stores = [StoreSpec("a", tokens, full_blocks, 0, group=1)]
    stores += [StoreSpec("a", tokens[:end], [block], 0, group=0) for end, block in states.items()]
    worker.worker.start_stores(StepPlan(stores=stores))
    worker.worker.settle_windowed_stores()
    worker.worker.preempted(["a"])


@pytest.mark.parametrize("device", REPLAY_DEVICES)
@pytest.mark.parametrize("fixture", FIXTURES, ids=lambda f: case_of(f).layout)
def test_a_state_moves_from_the_block_vllm_handed_over_into_the_one_it_allocated(
    fixture: dict[str, Any], device: str
) -> None:
    raw, views = replay(fixture, device)  # random bytes everywhere (the groups' pages share vLLM's tensors)
    hybrid = _worker(fixture, views)
    mamba = _groups(fixture)[0]
    as_bytes = {name: view.view(torch.uint8) for name, view in views.items()}  # random bytes hold NaNs
    try:
        tokens = [random.Random(4).randrange(32_000) for _ in range(4 * CHUNK + 9)]
        # vLLM's block pool is shared by the groups: the states' blocks and the attention blocks are distinct ids
        _store(hybrid, tokens[: 4 * CHUNK], [1, 2, 3, 4], {CHUNK: 5, 2 * CHUNK: 6, 3 * CHUNK: 7})
        hit = hybrid.lookups.lookup(tokens)
        assert hit is not None and hit.tokens == 3 * CHUNK  # no state at 4 chunks: the hit ends at the last one
        hybrid.lookups.free_lock(hit.lock)
        before = {name: view.clone() for name, view in as_bytes.items()}
        raw_before = raw.clone()
        # What vLLM allocates for a 3-chunk hit: the attention blocks, and for the state one block at index 2
        loads = [
            LoadSpec("b", tokens[: 3 * CHUNK], [10, 11, 12], 0, group=1),
            LoadSpec("b", tokens[: 3 * CHUNK], [NULL_BLOCK, NULL_BLOCK, 13], 2 * CHUNK, group=0),
        ]
        hybrid.worker.start_loads(StepPlan(loads=loads))
        assert hybrid.worker.take_load_errors() == set()
        if device == "cuda":
            torch.cuda.synchronize()
        state, copied = views[mamba.layer_names[0]].shape[3], CHUNK * row_bytes(4672, mamba.page_bytes, CHUNK)
        written = torch.zeros_like(raw)  # the bytes the loads may write, marked in vLLM's own views of them
        for name in mamba.layer_names:  # the state region of block 13's page: block 7's state
            assert torch.equal(as_bytes[name][13, 0, 0, :state], before[name][7, 0, 0, :state])
            page = views[name].storage_offset() + 13 * views[name].stride(0)
            written[page : page + copied] = 1  # the copied rows; the page past them stays as it was
        for name in _groups(fixture)[1].layer_names:
            assert torch.equal(as_bytes[name][[10, 11, 12]], before[name][[1, 2, 3]])
            written.view(views[name].dtype).as_strided(views[name].shape, views[name].stride(),
                                                       views[name].storage_offset())[[10, 11, 12]] = 1  # fmt: skip
        untouched = written == 0  # vLLM's null block 0 above all
        assert torch.equal(raw[untouched], raw_before[untouched])
        # A state is never read out of vLLM's null block: such a store fails, and nothing is stored for it
        _store(hybrid, tokens[: 4 * CHUNK], [1, 2, 3, 4], {4 * CHUNK: NULL_BLOCK})
        assert hybrid.worker.counters.store_failures == 1
        hit = hybrid.lookups.lookup(tokens)
        assert hit is not None and hit.tokens == 3 * CHUNK
        hybrid.lookups.free_lock(hit.lock)
    finally:
        hybrid.worker.close()
        hybrid.lookups.close()


@pytest.fixture
def hybrid() -> Iterator[HybridWorker]:
    fixture = FIXTURES[0]
    _, views = replay(fixture, "cpu")
    made = _worker(fixture, views)
    yield made
    made.worker.close()
    made.lookups.close()


def _evict_state(hybrid: HybridWorker, prefix: list[int]) -> None:
    states = hybrid.lookups.backends[0]
    assert isinstance(states, StateBackend) and isinstance(states.backend, EmbeddedBackend)
    backend = states.backend
    engine = backend.engine
    with engine._res.lock:
        key = engine.chunk_keys(state_key_tokens(prefix, CHUNK), namespace=backend.namespace)[0]
        entry = engine._res.index.get(key)
        assert entry is not None
        engine._res.detach_locked(entry)


def test_a_state_evicted_or_never_written_is_a_shorter_hit_or_a_miss(hybrid: HybridWorker) -> None:
    rng = random.Random(5)
    tokens = [rng.randrange(32_000) for _ in range(4 * CHUNK + 1)]
    _store(hybrid, tokens[: 4 * CHUNK], [1, 2, 3, 4], {CHUNK: 5, 3 * CHUNK: 7, 4 * CHUNK: 8})  # none at 2 chunks
    engine = hybrid.lookups.backends[1]
    assert isinstance(engine, EmbeddedBackend)

    def hit_of(prompt: list[int]) -> int:
        found = hybrid.lookups.lookup(prompt)
        assert found is not None
        hybrid.lookups.free_lock(found.lock)
        assert engine.engine.stats()["locks"] == 0  # every lock a lookup took is freed with its hit
        return found.tokens

    assert hit_of(tokens) == 4 * CHUNK
    assert hit_of(tokens[: 4 * CHUNK]) == 3 * CHUNK  # the prompt's last token is vLLM's to compute
    _evict_state(hybrid, tokens[: 4 * CHUNK])
    assert hit_of(tokens) == 3 * CHUNK  # the state before it serves the shorter prefix
    _evict_state(hybrid, tokens[: 3 * CHUNK])
    assert hit_of(tokens) == CHUNK  # never written at 2 chunks: the state at 1 chunk
    _evict_state(hybrid, tokens[:CHUNK])
    assert hit_of(tokens) == 0  # the attention chunks alone are no hit
    other = [rng.randrange(32_000) for _ in range(2 * CHUNK + 1)]
    _store(hybrid, other[: 2 * CHUNK], [1, 2], {})
    assert hit_of(other) == 0


def test_a_state_is_demoted_once_the_next_boundary_s_state_is_stored(hybrid: HybridWorker) -> None:
    tokens = [random.Random(6).randrange(32_000) for _ in range(3 * CHUNK + 1)]
    _store(hybrid, tokens[: 3 * CHUNK], [1, 2, 3], {CHUNK: 5})
    _store(hybrid, tokens[: 3 * CHUNK], [1, 2, 3], {2 * CHUNK: 6})  # a later step of the request
    states = hybrid.lookups.backends[0]
    assert isinstance(states, StateBackend) and isinstance(states.backend, EmbeddedBackend)
    engine, namespace = states.backend.engine, states.backend.namespace
    with engine._res.lock:  # first in the eviction order: the state at 1 chunk, superseded by the one at 2
        first = engine._res.policy.evict(1, lambda key: True)
    assert first == engine.chunk_keys(state_key_tokens(tokens[:CHUNK], CHUNK), namespace=namespace)
    hit = hybrid.lookups.lookup(tokens[: CHUNK + 1])  # demoted, not dropped: the shorter prompt still hits it
    assert hit is not None and hit.tokens == CHUNK
    hybrid.lookups.free_lock(hit.lock)


def _step(new: list[Any] = (), offers: dict[str, list[tuple[int, int, int]]] | None = None, **scheduled: int):
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], resumed_req_ids=set(), all_token_ids={}, new_block_ids=[], num_computed_tokens=[]
        ),
        num_scheduled_tokens=scheduled,
        preempted_req_ids=set(),
        kv_connector_block_state=SimpleNamespace(boundary_state_offloads=offers or {}),
    )


GROUPS = [KVGroup(0, "mamba", CHUNK, ("m",), page_bytes=32768), KVGroup(1, "full", CHUNK, ("a",))]


def test_the_scheduler_stores_the_states_vllm_hands_over_and_loads_the_one_block_it_allocated() -> None:
    side = SchedulerSide(lambda t: Hit(2 * CHUNK, "lock"), lambda lock: None, block_size=CHUNK, chunk_size=CHUNK,
                         in_background=True, tails=False)  # fmt: skip
    grouped = GroupedSchedulerSide(side, GROUPS)
    assert grouped.lead == 1  # plans over the full-attention group's table
    prompt = list(range(4 * CHUNK + 10))
    assert grouped.num_new_matched_tokens("r", prompt, len(prompt), 0) == (2 * CHUNK, True)
    grouped.after_alloc("r", prompt, ([NULL_BLOCK, 21], [11, 12]), 2 * CHUNK)  # vLLM's state block for the hit: 21
    state_load, full_load = sorted(grouped.build_plan(_step([], r=0)).loads, key=lambda load: load.group)
    assert (state_load.block_ids, state_load.skip_tokens) == ([NULL_BLOCK, 21], CHUNK)
    assert (full_load.block_ids, full_load.skip_tokens) == ([11, 12], 0)
    grouped.loads_done(["r"])
    tables = ([NULL_BLOCK, 21], [11, 12, 13, 14, 15])  # once loaded, vLLM schedules the rest of the prompt
    new = SimpleNamespace(req_id="r", prompt_token_ids=prompt, block_ids=tables, num_computed_tokens=2 * CHUNK)
    offers = {  # committed states: at 3 chunks (block 22), in the null block, off a chunk boundary, past the prompt
        "r": [(0, 22, 3 * CHUNK), (0, NULL_BLOCK, 4 * CHUNK), (0, 23, 3 * CHUNK + 16), (0, 24, 5 * CHUNK)],
        "gone": [(0, 25, CHUNK)],  # a request this side does not run
    }
    plan = grouped.build_plan(_step([new], offers, r=2 * CHUNK))
    assert plan.loads == []
    stores = [(s.group, len(s.tokens), s.block_ids, s.skip_tokens) for s in plan.stores]
    assert stores == [(1, 4 * CHUNK, [11, 12, 13, 14], 2 * CHUNK), (0, 3 * CHUNK, [22], 0)]
    assert grouped.request_finished("r", prompt[:-1], tables)  # vLLM keeps its blocks until the stores end


def test_a_state_loads_into_the_block_vllm_allocated_for_the_hit_and_only_in_the_background() -> None:
    """vLLM copies the hit's state block into the running one in the step that schedules the request, before a
    foreground load could fill it: a model with a state group loads in the background only, into that block."""
    foreground = SchedulerSide(lambda t: Hit(2 * CHUNK, "lock"), lambda lock: None, block_size=CHUNK,
                               chunk_size=CHUNK, tails=False)  # fmt: skip
    with pytest.raises(ValueError, match="background only"):
        GroupedSchedulerSide(foreground, GROUPS)
    side = SchedulerSide(lambda t: Hit(2 * CHUNK, "lock"), lambda lock: None, block_size=CHUNK, chunk_size=CHUNK,
                         in_background=True, tails=False)  # fmt: skip
    grouped = GroupedSchedulerSide(side, GROUPS)
    prompt = list(range(3 * CHUNK + 10))
    assert grouped.num_new_matched_tokens("r", prompt, len(prompt), 0) == (2 * CHUNK, True)
    grouped.after_alloc("r", prompt, ([NULL_BLOCK, 21], [11, 12]), 2 * CHUNK)  # vLLM's tables for the load alone
    plan = grouped.build_plan(_step([], r=0))
    states = [(load.block_ids, load.skip_tokens, load.in_background) for load in plan.loads if load.group == 0]
    assert states == [([NULL_BLOCK, 21], CHUNK, True)]
    assert {len(load.tokens) for load in plan.loads} == {2 * CHUNK}  # each the state after the hit


def test_a_state_vllm_computed_while_generating_is_stored_under_the_tokens_it_follows() -> None:
    """vLLM hands over a state past the prompt in the step that computes it; its key is the request's tokens then
    (vLLM's live ``all_token_ids``), and the finish stores the attention chunks up to there (a chat's next turn)."""
    side = SchedulerSide(
        lambda t: Hit(0), lambda lock: None, block_size=CHUNK, chunk_size=CHUNK, in_background=True, tails=False
    )
    grouped = GroupedSchedulerSide(side, GROUPS)
    prompt = list(range(1000, 1000 + 2 * CHUNK + 10))
    tokens = list(prompt)  # vLLM's Request._all_token_ids: it appends each generated token
    tables = ([NULL_BLOCK, NULL_BLOCK, 31], [11, 12, 13])
    for req_id, live in (("r", tokens), ("no-tokens", [])):
        assert grouped.num_new_matched_tokens(req_id, prompt, len(prompt), 0) == (0, False)
        grouped.after_alloc(req_id, prompt, tables, 0, live)
    new = [SimpleNamespace(req_id=r, prompt_token_ids=prompt, block_ids=tables, num_computed_tokens=0)
           for r in ("r", "no-tokens")]  # fmt: skip
    grouped.build_plan(_step(new, **{"r": len(prompt), "no-tokens": len(prompt)}))
    offers = {"r": [(0, 31, 3 * CHUNK)], "no-tokens": [(0, 31, 3 * CHUNK)]}
    decode = _step(offers=offers, r=1)
    decode.scheduled_cached_reqs = SimpleNamespace(
        req_ids=["r", "no-tokens"],
        resumed_req_ids=set(),
        all_token_ids={},
        new_block_ids=[None, None],
        num_computed_tokens=[3 * CHUNK - 1] * 2,
    )
    assert grouped.build_plan(decode).stores == []  # vLLM has not appended the tokens up to the boundary yet
    tokens += [7] * (3 * CHUNK - len(prompt))  # what the request generated up to the boundary
    (store,) = grouped.build_plan(decode).stores  # only the request whose tokens are known
    assert store == StoreSpec("r", tokens[: 3 * CHUNK], [31], 0, group=0)
    tokens += [8] * 5
    assert grouped.request_finished("r", tokens[:-1], tables)
    (finish,) = grouped.build_plan(_step()).stores  # the attention chunks up to the boundary too
    assert (finish.group, list(finish.tokens), finish.block_ids) == (1, tokens[: 3 * CHUNK], [11, 12, 13])


def test_a_hybrid_with_a_state_group_looks_up_the_state_at_the_hit_s_end_only() -> None:
    """A stub per group: the full group holds 4 chunks, the state group states at 1 and 3 chunks."""
    held = {CHUNK, 3 * CHUNK}
    asked: list[int] = []

    class States:
        chunk_size = CHUNK

        def lookup(self, tokens: list[int]) -> Hit:
            asked.append(len(tokens))
            return Hit(len(tokens), f"s{len(tokens)}") if len(tokens) in held else Hit(0)

        def free_lock(self, lock: Any) -> None:
            freed.append(lock)

    freed: list[Any] = []
    full = SimpleNamespace(
        chunk_size=CHUNK, lookup=lambda t, first_chunk=0: Hit(4 * CHUNK, "f"), free_lock=freed.append
    )
    from kvferry.connector.kv_groups import GroupedLookups

    lookups = GroupedLookups([States(), full], GROUPS)
    assert lookups.lookup(list(range(4 * CHUNK + 1))) == Hit(3 * CHUNK, ("s192", "f"))
    assert asked == [4 * CHUNK, 3 * CHUNK] and freed == []  # the longest boundary first; a state miss holds nothing
    held.clear()
    assert lookups.lookup(list(range(4 * CHUNK + 1))) == Hit(0)
    assert freed == ["f"]  # no state at any boundary: the attention groups' lock goes

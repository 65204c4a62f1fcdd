"""The worker half of the vLLM connector with a scripted backend (no vLLM, no cache engine)."""

from __future__ import annotations

import logging
import random
import sys
import threading
from concurrent.futures import Future

import pytest

from kvferry.connector.plan import LoadSpec, StepPlan, StoreSpec
from kvferry.connector.worker_side import HANDOFF_S, WorkerSide

BS = 32


class ScriptedBackend:
    """Records calls; a load answers ``self.leading`` (or fails with it) at once, or stays pending while
    ``hold_loads``; stores give pending futures."""

    def __init__(self) -> None:
        self.leading: int | Exception | None = None  # None: everything asked for
        self.hold_loads = False
        self.foreground = 0  # loads asked for through `retrieve` (run to the end by the caller)
        self.retrieves: list[tuple[list[int], list[int], int, Future[int]]] = []
        self.stores: list[tuple[list[int], list[int], int, Future[int]]] = []

    def retrieve_async(self, tokens: list[int], block_ids: list[int], skip_prefix_tokens: int) -> Future[int]:
        future: Future[int] = Future()
        self.retrieves.append((tokens, block_ids, skip_prefix_tokens, future))
        if not self.hold_loads:
            self.answer(future, len(tokens))
        return future

    def retrieve(self, tokens: list[int], block_ids: list[int], skip_prefix_tokens: int) -> int:
        self.foreground += 1
        return self.retrieve_async(tokens, block_ids, skip_prefix_tokens).result()

    def answer(self, future: Future[int], asked: int) -> None:
        if isinstance(self.leading, Exception):
            future.set_exception(self.leading)
        else:
            future.set_result(asked if self.leading is None else self.leading)

    def store_async(self, tokens: list[int], block_ids: list[int], skip_prefix_tokens: int) -> Future[int]:
        future: Future[int] = Future()
        self.stores.append((tokens, block_ids, skip_prefix_tokens, future))
        return future


def tokens(n: int) -> list[int]:
    rng = random.Random(n)
    return [rng.randrange(32_000) for _ in range(n)]


IDS = [17, 3, 40, 8, 22, 9, 31, 5]


def test_load_calls_the_backend_and_hands_the_written_blocks_to_the_hook() -> None:
    backend, seen = ScriptedBackend(), []
    worker = WorkerSide(backend, block_size=BS, after_load=seen.append)
    worker.start_loads(StepPlan(loads=[LoadSpec("a", tokens(256), IDS, skip_tokens=64)]))
    assert [r[:3] for r in backend.retrieves] == [(tokens(256), IDS, 64)]
    assert backend.foreground == 1  # run to its end by the backend on this thread (`retrieve`)
    assert seen == [IDS[2:]]  # the two skipped blocks are vLLM's: never written, never handed to the hook
    assert worker.take_load_errors() == set()
    assert worker.counters.tokens_loaded == 192 and worker.counters.loads == 1
    assert worker.take_load_report() == ({"a"}, set())


def test_a_short_load_reports_exactly_the_blocks_not_written(caplog: pytest.LogCaptureFixture) -> None:
    backend, seen = ScriptedBackend(), []
    worker = WorkerSide(backend, block_size=BS, after_load=seen.append)
    backend.leading = 128  # the second chunk was evicted between lookup and load
    with caplog.at_level(logging.WARNING):
        worker.start_loads(StepPlan(loads=[LoadSpec("a", tokens(256), IDS, skip_tokens=0)]))
    assert worker.take_load_errors() == set(IDS[4:])
    assert worker.take_load_errors() == set()  # reported once
    assert seen == [IDS[:4]]  # the hook sees only the blocks written
    assert "loaded 128 of 256 tokens" in caplog.text
    backend.leading = RuntimeError("server gone")
    with caplog.at_level(logging.WARNING):
        worker.start_loads(StepPlan(loads=[LoadSpec("b", tokens(256), IDS, skip_tokens=64)]))
    assert worker.take_load_errors() == set(IDS[2:])
    assert "server gone" in caplog.text
    assert seen == [IDS[:4]]  # nothing written, no hook call
    assert worker.counters.tokens_loaded == 128 and worker.counters.load_failures == 2
    assert worker.take_load_report() == ({"a", "b"}, {"a", "b"})


def test_stores_keep_the_request_unfinished_until_they_complete() -> None:
    backend = ScriptedBackend()
    worker = WorkerSide(backend, block_size=BS)
    worker.start_stores(StepPlan(stores=[StoreSpec("a", tokens(256), IDS, 0), StoreSpec("b", tokens(128), IDS[:4], 0)]))
    assert [s[:3] for s in backend.stores] == [(tokens(256), IDS, 0), (tokens(128), IDS[:4], 0)]
    assert worker.finished_sending({"a", "c"}) == set()  # "a" still storing; "c" never stored anything
    backend.stores[0][3].set_result(256)
    assert worker.finished_sending(set()) == {"a"}  # reported once its stores are done
    assert worker.finished_sending(set()) == set()
    backend.stores[1][3].set_result(128)
    assert worker.finished_sending(set()) == set()  # "b" done storing but not finished by vLLM yet
    assert worker.finished_sending({"b"}) == {"b"}
    assert worker.counters.tokens_stored == 384 and worker.counters.stores == 2


def test_a_failed_store_is_logged_and_still_releases_the_request(caplog: pytest.LogCaptureFixture) -> None:
    backend = ScriptedBackend()
    worker = WorkerSide(backend, block_size=BS)
    worker.start_stores(StepPlan(stores=[StoreSpec("a", tokens(256), IDS, 0)]))
    backend.stores[0][3].set_exception(OSError("pool full"))
    with caplog.at_level(logging.WARNING):
        assert worker.finished_sending({"a"}) == {"a"}
    assert worker.counters.store_failures == 1
    assert "a store for request a failed" in caplog.text


def test_preempted_requests_wait_for_their_stores_and_are_forgotten() -> None:
    backend = ScriptedBackend()
    worker = WorkerSide(backend, block_size=BS)
    worker.start_stores(StepPlan(stores=[StoreSpec("a", tokens(256), IDS, 0)]))
    future = backend.stores[0][3]
    threading.Timer(0.05, future.set_result, args=(256,)).start()
    worker.preempted(["a", "not-storing"])
    assert future.done()
    assert worker.finished_sending({"a"}) == set()  # vLLM freed its blocks at the preemption: nothing to report
    assert worker.counters.tokens_stored == 256
    worker.close()


def test_background_loads_are_reported_once_done_with_their_failed_blocks() -> None:
    backend, seen = ScriptedBackend(), []
    worker = WorkerSide(backend, block_size=BS, after_load=seen.append)
    backend.hold_loads = True
    loads = [LoadSpec(r, tokens(256), IDS, 0, in_background=True) for r in ("a", "b")]
    worker.start_loads(StepPlan(loads=loads))
    assert backend.foreground == 0  # started through `retrieve_async`, not waited for
    assert worker.finished_loading() == set()  # running: the step does not wait for them
    assert worker.take_load_report() == (set(), set())
    backend.answer(backend.retrieves[1][3], 256)
    assert worker.finished_loading() == {"b"}
    backend.leading = 128
    backend.answer(backend.retrieves[0][3], 256)
    assert worker.finished_loading() == {"a"}
    assert worker.take_load_errors() == set(IDS[4:])  # reported with the request, in the same step
    assert worker.take_load_report() == ({"a", "b"}, {"a"})
    assert seen == [IDS, IDS[:4]]
    worker.close()


def test_close_waits_for_background_loads() -> None:
    backend = ScriptedBackend()
    worker = WorkerSide(backend, block_size=BS)
    backend.hold_loads = True
    worker.start_loads(StepPlan(loads=[LoadSpec("a", tokens(256), IDS, 0, in_background=True)]))
    threading.Timer(0.05, backend.answer, args=(backend.retrieves[0][3], 256)).start()
    worker.close()
    assert worker.counters.tokens_loaded == 256


def test_the_gil_changes_hands_quickly_only_while_loads_or_stores_run() -> None:
    default = sys.getswitchinterval()
    backend, other = ScriptedBackend(), ScriptedBackend()
    backend.hold_loads = True
    worker = WorkerSide(backend, block_size=BS)
    another_engine = WorkerSide(other, block_size=BS)  # the interval is the process's: one holder for both
    worker.start_loads(StepPlan(loads=[LoadSpec("a", tokens(256), IDS, skip_tokens=0, in_background=True)]))
    another_engine.start_stores(StepPlan(stores=[StoreSpec("b", tokens(256), IDS, skip_tokens=0)]))
    assert sys.getswitchinterval() == pytest.approx(HANDOFF_S)
    backend.answer(backend.retrieves[0][3], 256)
    assert sys.getswitchinterval() == pytest.approx(HANDOFF_S)  # the other engine's store still runs
    other.stores[0][3].set_exception(RuntimeError("the server went away"))
    assert sys.getswitchinterval() == default
    backend.hold_loads = False
    worker.start_loads(StepPlan(loads=[LoadSpec("c", tokens(256), IDS, skip_tokens=0)]))  # done at once
    assert sys.getswitchinterval() == default
    assert worker.finished_loading() == {"a"}


class CopyingBackend(ScriptedBackend):
    """Stores as in process on a GPU: each a `Rest` whose copy's end comes before its bookkeeping."""

    def __init__(self, stores: list[Future[int]]) -> None:
        super().__init__()
        self.pending = list(stores)

    def store_async(self, tokens: list[int], block_ids: list[int], skip_prefix_tokens: int) -> Future[int]:
        return self.pending.pop(0)


def test_a_store_is_done_for_vllm_at_its_copy_s_end_before_its_bookkeeping() -> None:
    """The request is reported (and a preempted one let go) once its store's copy ended, its tokens counted, while
    its chunks are still being made readable (the cache settles that before it is read: `test_cache_stored_early`)."""
    from tests.cache.test_cache_stored_early import Copy, copying_store

    copies, log = [Copy(), Copy()], []
    stores = [copying_store(copy, log) for copy in copies]
    worker = WorkerSide(CopyingBackend(list(stores)), block_size=BS)
    worker.start_stores(StepPlan(stores=[StoreSpec("a", tokens(256), IDS, 0), StoreSpec("b", tokens(256), IDS, 0)]))
    assert worker.finished_sending({"a"}) == set()
    copies[0].ended.set()
    assert worker.finished_sending(set()) == {"a"} and not stores[0].done() and log == []
    threading.Timer(0.05, copies[1].ended.set).start()
    worker.preempted(["b"])  # waits for its copy only
    assert copies[1].ended.is_set() and not stores[1].done()
    assert worker.counters.tokens_stored == 128 and worker.counters.stores == 2  # each stand-in store: 64 tokens

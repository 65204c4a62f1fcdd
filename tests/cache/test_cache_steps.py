"""A store or retrieve run as steps (what the server does: up to the copy's enqueue on one thread, the rest on
another): the first step stops at the copy, the rest makes it count, and steps abandoned after the first still
finish their bookkeeping, so no object, reader or lock outlives them."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import pytest

from kvferry.cache import CacheEngine
from kvferry.cache.steps import Enqueued, Finished, Rest, Steps, finish_steps, first_step, run_steps, submitted
from kvferry.config import KvferryConfig
from kvferry.formats.kinds import EngineKVFormat as F
from kvferry.memory import HostPool
from kvferry.transfer import api
from tests.cache.cachekit import BS, CHUNK, assert_blocks_equal, make_paged, random_tokens

FMT = F.NL_X_TWO_NB_BS_NH_HS
NB = 32


def _engine() -> CacheEngine:
    config = KvferryConfig.load(env={}, overrides={"cache": {"chunk_size": CHUNK}})
    return CacheEngine(config, pool=HostPool(64 * 4096, pin=False))


def test_a_store_counts_only_once_its_steps_finish() -> None:
    src = make_paged(FMT, NB, seed=1)
    tokens, ids = random_tokens(3 * CHUNK, 1), list(range(3 * CHUNK // BS))
    with _engine() as engine:
        ns = engine.namespace_for("m", FMT, src)
        steps = engine.store_steps(tokens, src, ids, FMT, namespace=ns)
        first = first_step(steps)
        assert first == Enqueued(None, 3 * CHUNK, True)  # on the CPU the copy is done when it is "enqueued"
        assert engine.lookup(tokens, namespace=ns) == 0  # written, not yet readable
        assert finish_steps(steps) == 3 * CHUNK
        assert engine.lookup(tokens, namespace=ns) == 3 * CHUNK


def test_steps_closed_after_the_enqueue_still_settle_their_chunks() -> None:
    src, dst = make_paged(FMT, NB, seed=2), make_paged(FMT, NB, seed=3)
    tokens, ids = random_tokens(2 * CHUNK, 2), list(range(2 * CHUNK // BS))
    with _engine() as engine:
        ns = engine.namespace_for("m", FMT, src)
        steps = engine.store_steps(tokens, src, ids, FMT, namespace=ns)
        assert isinstance(first_step(steps), Enqueued)
        steps.close()  # abandoned (a worker pool that is shutting down, say): its copy is waited for and counted
        assert engine.lookup(tokens, namespace=ns) == 2 * CHUNK
        lock = engine.lookup_status(tokens, namespace=ns, lock=True).lock_id
        steps = engine.retrieve_steps(tokens, dst, ids[::-1], FMT, namespace=ns, lock_id=lock)
        assert first_step(steps) == Enqueued(None, 2 * CHUNK, False, landed=True)
        steps.close()
        assert engine.free_lookup_locks(lock) is False  # the retrieve's end released it
        assert engine.stats()["pinned_objects"] == 0  # and its readers
        assert_blocks_equal(src, ids, dst, ids[::-1], FMT)
        engine.clear()
        assert engine.stats()["pool_used_bytes"] == 0


def test_a_miss_and_a_store_of_present_chunks_end_without_a_copy() -> None:
    src = make_paged(FMT, NB, seed=4)
    tokens, ids = random_tokens(CHUNK, 4), list(range(CHUNK // BS))
    with _engine() as engine:
        ns = engine.namespace_for("m", FMT, src)
        assert first_step(engine.retrieve_steps(tokens, src, ids, FMT, namespace=ns)) == Finished(0)
        assert run_steps(engine.store_steps(tokens, src, ids, FMT, namespace=ns)) == CHUNK
        first = first_step(engine.store_steps(tokens, src, ids, FMT, namespace=ns))
        assert first == Enqueued(None, 0, True)  # present: nothing new to copy


def test_a_store_with_a_tail_is_not_final_at_its_chunks_copy() -> None:
    """The tail object is written after the chunks' copy, so their count is not the store's result: a server that
    answered with it (a done flag's early answer) would report the tail's tokens as not stored."""
    src = make_paged(FMT, NB, seed=5)
    tokens, ids = random_tokens(3 * CHUNK, 5)[: 2 * CHUNK + BS + 1], list(range(2 * CHUNK // BS + 1))
    with _engine() as engine:
        ns = engine.namespace_for("m", FMT, src)
        steps = engine.store_steps(tokens, src, ids, FMT, namespace=ns, tail=True)
        assert first_step(steps) == Enqueued(None, 2 * CHUNK, False)
        assert finish_steps(steps) == 2 * CHUNK + BS
        again = engine.store_steps(tokens, src, ids, FMT, namespace=ns, tail=True)
        assert first_step(again) == Enqueued(None, 0, False)  # the tail's own check comes after
        assert finish_steps(again) == 0


def test_steps_that_yield_twice_are_refused() -> None:
    def twice():  # type: ignore[no-untyped-def]
        yield Enqueued(None, 0, True)
        yield Enqueued(None, 0, True)
        return 1

    steps = twice()
    next(steps)
    with pytest.raises(RuntimeError, match="yield once"):
        finish_steps(steps)


def test_started_transfers_run_to_their_copy_here_and_finish_on_the_waiter() -> None:
    """`CacheEngine.store_async` / `retrieve_async` with ``start_here``: the copy is made on the calling thread (a
    GPU engine's is then ordered after its current stream), the rest on the engine's workers; a failure before the
    copy and a transfer with nothing to copy are futures too, never raised at the caller."""
    src, dst = make_paged(FMT, NB, seed=6), make_paged(FMT, NB, seed=7)
    tokens, ids = random_tokens(2 * CHUNK, 6), list(range(2 * CHUNK // BS))
    with _engine() as engine:
        ns = engine.namespace_for("m", FMT, src)
        assert (
            engine.retrieve_async(tokens, dst, ids, FMT, namespace=ns, start_here=True).result() == 0
        )  # a miss: no copy
        stored = engine.store_async(tokens, src, ids, FMT, namespace=ns, start_here=True)
        assert stored.result() == 2 * CHUNK
        loaded = engine.retrieve_async(tokens, dst, ids[::-1], FMT, namespace=ns, start_here=True)
        assert loaded.result() == 2 * CHUNK
        assert_blocks_equal(src, ids, dst, ids[::-1], FMT)
        bad = engine.retrieve_async(tokens, dst, [NB + 5] * len(ids), FMT, namespace=ns, start_here=True)
        with pytest.raises(ValueError):
            bad.result()
        assert engine.stats()["pinned_objects"] == 0


def _stalled_executor() -> tuple[Any, threading.Event]:
    """A one-thread executor whose worker is held until the returned event is set."""
    executor = ThreadPoolExecutor(1)
    go = threading.Event()
    executor.submit(go.wait)
    return executor, go


def _store_steps(engine: CacheEngine, seed: int) -> tuple[Any, list[int], Any]:
    src = make_paged(FMT, NB, seed=seed)
    tokens, ids = random_tokens(2 * CHUNK, seed), list(range(2 * CHUNK // BS))
    ns = engine.namespace_for("m", FMT, src)
    steps = engine.store_steps(tokens, src, ids, FMT, namespace=ns)
    assert isinstance(first_step(steps), Enqueued)
    return tokens, ids, (steps, ns)


def test_the_rest_of_a_transfer_runs_on_the_first_thread_that_waits_for_it() -> None:
    executor, go = _stalled_executor()
    with _engine() as engine:
        tokens, _, (steps, ns) = _store_steps(engine, 5)
        ran_on: list[str] = []
        rest = Rest.submit(executor, None, steps)
        rest.add_done_callback(lambda _: ran_on.append(threading.current_thread().name))
        assert not rest.done() and rest.cancel() is False
        release = threading.Timer(5.0, go.set)  # a rest left to the worker fails below rather than hangs
        release.start()
        assert rest.result() == 2 * CHUNK  # the worker is held: this thread ran the rest
        release.cancel()
        assert ran_on == [threading.current_thread().name]
        assert engine.lookup(tokens, namespace=ns) == 2 * CHUNK
        go.set()
        executor.shutdown(wait=True)  # the worker then finds it taken: nothing runs twice
        assert rest.result() == 2 * CHUNK and engine.stats()["stores"] == 1


def test_a_waiter_with_a_timeout_leaves_the_rest_to_the_worker() -> None:
    executor, go = _stalled_executor()
    with _engine() as engine:
        _, _, (steps, _) = _store_steps(engine, 6)
        rest = Rest.submit(executor, None, steps)
        with pytest.raises(FutureTimeout):
            rest.result(timeout=0.05)
        with pytest.raises(FutureTimeout):
            rest.exception(timeout=0.05)
        go.set()
        assert rest.result(timeout=30) == 2 * CHUNK  # run by the worker
        executor.shutdown(wait=True)


def test_a_failing_rest_fails_its_future_once_whoever_runs_it() -> None:
    def failing() -> Steps[int]:
        yield Enqueued(None, CHUNK, True)
        raise RuntimeError("the copy failed")

    executor, go = _stalled_executor()
    steps = failing()
    next(steps)
    rest = Rest.submit(executor, None, steps)
    error = rest.exception()
    assert isinstance(error, RuntimeError) and str(error) == "the copy failed"
    go.set()
    executor.shutdown(wait=True)
    with pytest.raises(RuntimeError, match="the copy failed"):
        rest.result()


class _Marker:
    """Stand-in `StreamMarker`: marks numbered from 100, and when each was recorded and released."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def record(self) -> _Mark:
        self.log.append("marked")
        return _Mark(self.log, 100 + self.log.count("marked"))


class _Mark:
    def __init__(self, log: list[str], event: int) -> None:
        self.log, self.cuda_event = log, event

    def release(self, _: Any = None) -> None:
        self.log.append(f"released {self.cuda_event}")


def test_a_transfer_started_here_marks_the_callers_stream_once_its_copy_is_in_flight() -> None:
    log: list[str] = []

    def steps() -> Steps[int]:
        log.append("enqueued")
        yield Enqueued(None, CHUNK, True)
        log.append(f"rest after {api._order.event}")  # what the rest's GPU copies would wait for
        return CHUNK

    with ThreadPoolExecutor(1) as executor:
        future = submitted(executor, lambda: 0, steps, (), {}, None, True, _Marker(log))
        assert future.result() == CHUNK
    assert log == ["enqueued", "marked", "rest after 101", "released 101"]
    log.clear()

    def failing() -> Steps[int]:
        raise ValueError("bad block ids")
        yield Enqueued(None, 0, True)

    with ThreadPoolExecutor(1) as executor:
        failed = submitted(executor, lambda: 0, failing, (), {}, None, True, _Marker(log))
        assert isinstance(failed.exception(), ValueError) and log == []  # nothing in flight: no mark


def test_the_rest_of_a_transfer_an_executor_shut_down_refuses_runs_on_the_callers_thread() -> None:
    executor = ThreadPoolExecutor(1)
    executor.shutdown()
    with _engine() as engine:
        tokens, _, (steps, ns) = _store_steps(engine, 7)
        rest = Rest.submit(executor, None, steps)
        assert rest.done() and rest.result() == 2 * CHUNK
        assert engine.lookup(tokens, namespace=ns) == 2 * CHUNK


class _Copy:
    """Stand-in `TransferHandle` of a GPU copy that ends when ``ended`` is set, or fails with ``error``."""

    def __init__(self, error: Exception | None = None) -> None:
        self.ended = threading.Event()
        self.error = error

    def wait(self) -> None:
        self.ended.wait(5.0)
        if self.error is not None:
            raise self.error


def _load_steps(copy: _Copy, after_copy: threading.Event, log: list[str]) -> Steps[int]:
    """A load's steps as the reader yields them: its copy in flight, then (the readers let go) once it ended."""
    try:
        yield Enqueued(copy, 3 * CHUNK, True, landed=True)  # type: ignore[arg-type]  # a stand-in handle
    finally:
        copy.wait()
        log.append("copy waited")
        after_copy.wait(5.0)
        log.append("readers let go")
    return 3 * CHUNK


def test_a_load_s_rest_resolves_when_its_copy_ends_and_lets_go_of_its_readers_after() -> None:
    copy, after_copy, log = _Copy(), threading.Event(), []
    steps = _load_steps(copy, after_copy, log)
    first = first_step(steps)
    assert isinstance(first, Enqueued)
    with ThreadPoolExecutor(1) as executor:
        rest = Rest.submit(executor, None, steps, first)
        assert not rest.done()
        copy.ended.set()
        assert rest.result(timeout=5) == 3 * CHUNK  # before the readers were let go
        assert "readers let go" not in log
        after_copy.set()
    assert log == ["copy waited", "readers let go"]


def test_a_load_whose_copy_fails_fails_its_rest_after_settling() -> None:
    copy, after_copy, log = _Copy(RuntimeError("an illegal address")), threading.Event(), []
    after_copy.set()
    steps = _load_steps(copy, after_copy, log)
    first = first_step(steps)
    with ThreadPoolExecutor(1) as executor:
        rest = Rest.submit(executor, None, steps, first)  # type: ignore[arg-type]
        copy.ended.set()
        with pytest.raises(RuntimeError, match="an illegal address"):
            rest.result(timeout=5)
    assert log == []  # the steps' own wait raised before their bookkeeping: nothing reported as moved


def test_a_store_s_rest_resolves_only_once_its_chunks_are_readable() -> None:
    with _engine() as engine:
        tokens, _, (steps, ns) = _store_steps(engine, 9)
        with ThreadPoolExecutor(1) as executor:
            rest = Rest.submit(executor, None, steps, Enqueued(None, 2 * CHUNK, True))
            assert rest.result(timeout=30) == 2 * CHUNK
            assert engine.lookup(tokens, namespace=ns) == 2 * CHUNK

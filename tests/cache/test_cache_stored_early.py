"""Stores their callers take as done at their copy's end (`Rest.copy_end`, `StoredEarly`, `connector.copy_ends`): the
engine gets its blocks back when the GPU has copied them, and the cache, before it is read, finishes the bookkeeping
of every such store whose copy has ended (on the reading thread, or waiting for the worker that runs it), so a store
seen done is found. GPU copies stood in for (the GPU tests run the same through the vLLM connector and the SGLang
linker)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from kvferry.cache import CacheEngine, steps
from kvferry.cache.steps import Enqueued, Rest, Steps, StoredEarly, copy_end, first_step
from kvferry.config import KvferryConfig
from kvferry.connector.copy_ends import copied, copied_probe
from kvferry.formats.kinds import EngineKVFormat
from kvferry.memory import HostPool
from tests.cache.cachekit import BS, CHUNK, make_paged, random_tokens

FMT = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS


class Copy:
    """Stand-in `TransferHandle` of a GPU copy that ends when ``ended`` is set."""

    def __init__(self) -> None:
        self.ended = threading.Event()

    def done(self) -> bool:
        return self.ended.is_set()

    def wait(self) -> None:
        assert self.ended.wait(5.0)


def copying_store_steps(
    copy: Copy, log: list[str], final: bool = True, hold: threading.Event | None = None
) -> Steps[int]:
    """A store's steps, its copy in flight: its rest makes the chunks readable (logged) once the copy ended."""
    yield Enqueued(copy, 64, final)  # type: ignore[arg-type]  # a stand-in handle
    copy.wait()
    if hold is not None:
        hold.wait(5.0)
    log.append(f"readable on {threading.current_thread().name}")
    return 64


def _started(steps: Steps[int]) -> tuple[Steps[int], Enqueued]:
    first = first_step(steps)
    assert isinstance(first, Enqueued)
    return steps, first


def copying_store(copy: Copy, log: list[str], final: bool = True, hold: threading.Event | None = None) -> Rest:
    """A store's `Rest` of `copying_store_steps`, not submitted."""
    return Rest(None, *_started(copying_store_steps(copy, log, final, hold)))


def test_a_store_s_copy_end_and_tokens_come_before_its_bookkeeping() -> None:
    copy, log = Copy(), []
    rest = copying_store(copy, log)
    assert copy_end(rest) is copy and copied_probe(rest) is not None
    probe = copied_probe(rest)
    assert probe is not None and not probe()
    copy.ended.set()
    assert probe() and copied(rest) == 64  # the engine's wait: the copy's end, the rest not run
    assert log == [] and not rest.done()
    rest.run()
    assert rest.result() == 64 and log == [f"readable on {threading.current_thread().name}"]


def test_a_worker_hands_the_gil_over_at_the_copy_s_end_before_the_bookkeeping(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    monkeypatch.setattr(steps, "_yield_gil", lambda: log.append("handed over"))
    copy = Copy()
    with ThreadPoolExecutor(1, thread_name_prefix="worker") as executor:
        rest = Rest.submit(executor, None, *_started(copying_store_steps(copy, log)))
        time.sleep(0.05)
        assert log == []  # the worker waits for the copy's end
        copy.ended.set()
        assert rest.result(5) == 64
    assert log == ["handed over", "readable on worker_0"]

    helped: list[str] = []
    monkeypatch.setattr(steps, "_yield_gil", lambda: helped.append("handed over"))
    copy = Copy()
    copy.ended.set()
    rest = copying_store(copy, helped)
    assert rest.result() == 64  # run by the thread that waits for it: nothing to hand over to
    assert helped == [f"readable on {threading.current_thread().name}"]


def test_the_cache_settles_stores_whose_copy_ended_and_leaves_the_copying_ones() -> None:
    early, log = StoredEarly(), []
    ended, copying = Copy(), Copy()
    first, second = copying_store(ended, log), copying_store(copying, log)
    early.add(first)
    early.add(second)
    ended.ended.set()
    early.settle()  # before a lookup: the ended one made readable on this thread
    assert log == [f"readable on {threading.current_thread().name}"] and first.done() and not second.done()
    copying.ended.set()
    early.settle()
    assert second.done() and len(log) == 2
    assert early._rests == set()  # forgotten once done


def test_a_settle_waits_for_the_worker_that_runs_a_store_s_bookkeeping() -> None:
    early, log, hold = StoredEarly(), [], threading.Event()
    copy = Copy()
    rest = copying_store(copy, log, hold=hold)
    early.add(rest)
    copy.ended.set()
    with ThreadPoolExecutor(1, thread_name_prefix="worker") as executor:
        executor.submit(rest.run)
        threading.Timer(0.1, hold.set).start()
        early.settle()  # the worker took it: waited for, not run twice
        assert rest.done() and log == ["readable on worker_0"]


def test_only_stores_seen_done_at_their_copy_end_are_followed() -> None:
    early, log = StoredEarly(), []
    not_final = copying_store(Copy(), log, final=False)  # a tail to write after: done only at its end
    plain: Future[int] = Future()
    early.add(not_final)
    early.add(plain)
    assert copy_end(not_final) is None and copied_probe(not_final) is None and copied_probe(plain) is None
    assert early._rests == set()
    plain.set_result(3)
    assert copied(plain) == 3


@pytest.mark.parametrize("read", ["lookup", "lookup_status", "prefetch", "retrieve"])
def test_the_cache_settles_them_before_each_read(read: str) -> None:
    config = KvferryConfig.load(env={}, overrides={"cache": {"chunk_size": CHUNK}})
    with CacheEngine(config, pool=HostPool(64 * 4096, pin=False)) as engine:
        copy, log = Copy(), []
        rest = copying_store(copy, log)
        engine._stored_early.add(rest)
        copy.ended.set()
        tokens, paged = random_tokens(2 * CHUNK, 3), make_paged(FMT, 8, seed=3)
        ns = engine.namespace_for("m", FMT, paged)
        if read == "retrieve":
            engine.retrieve(tokens, paged, list(range(2 * CHUNK // BS)), FMT, namespace=ns)
        elif read == "prefetch":
            engine.prefetch(tokens, namespace=ns).result(5)
        else:
            getattr(engine, read)(tokens, namespace=ns)
        assert rest.done() and len(log) == 1

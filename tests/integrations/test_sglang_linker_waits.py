"""A load through a server waited for on the forward's thread (`_Batch.wait_here`, `copy_ends.wait_here`): the moves
the server answered before their copies ended (`FlagFuture`) of the groups of layers up to the one waited for are
waited for there and complete their layers there; later groups' moves, and moves of other kinds, are not."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from kvferry.client.done_flags import FlagFuture, _Watched
from kvferry.connector.copy_ends import wait_here
from kvferry.integrations.sglang.linker_store import _Batch
from kvferry.integrations.sglang.load_counter import LoadCounter

GROUPS = [range(0, 2), range(2, 4)]


class Store:
    """What a `_Batch` reads of its `LinkerStore`."""

    def __init__(self) -> None:
        self.layer_groups, self.page_size, self.counter = GROUPS, 4, LoadCounter(4)

        class Batches:
            def add(self, batch: object) -> None:
                pass

        class Ended:
            def put(self, task: object) -> None:
                pass

        self._batches, self._ended = Batches(), Ended()


class Flag:
    """A done flag the GPU writes ``after_s`` from now."""

    def __init__(self, after_s: float) -> None:
        self.at = time.monotonic() + after_s

    def is_set(self, slot: int, seq: int) -> bool:
        return time.monotonic() >= self.at

    def release(self, slot: int) -> None:
        pass


def _answered(flag: Flag | None = None) -> FlagFuture:
    """A transfer answered before its copy ended, its done flag ``flag`` (None: answered after it; the future then
    resolves by another thread's hand only)."""
    future = FlagFuture()
    watched = None
    if flag is not None:
        watched = _Watched(flag, 0, 1, future, 4, time.monotonic() + 5)  # type: ignore[arg-type]  # a stand-in flag
    future.answered(watched)
    return future


def test_the_forward_s_thread_waits_for_the_moves_up_to_its_layer_s_group_and_they_complete_there() -> None:
    store = Store()
    index = store.counter.update_producer()
    first, second = _answered(Flag(0.005)), _answered(Flag(60))  # within `LOOK_S` of the wait
    batch = _Batch(store, index, [])  # type: ignore[arg-type]  # a stand-in store
    batch.follow([[(1, first)], [(1, second)]], None)
    store.counter.on_host(index, batch.wait_here)
    store.counter.set_consumer(index)
    resolved_on: list[str] = []
    first.add_done_callback(lambda _: resolved_on.append(threading.current_thread().name))
    give_up = threading.Timer(2.0, lambda: store.counter.fail(index, RuntimeError("not waited for here")))
    give_up.start()  # without the wait here, nothing would complete the layer: fail it rather than hang
    store.counter.wait_until(1)  # waits for the first group's move only (the second's flag is a minute away)
    give_up.cancel()
    assert first.done() and not second.done() and store.counter.landed(index, 1)
    assert not store.counter.landed(index, 2)
    assert resolved_on == [threading.current_thread().name]  # its flag seen, and its layers completed, here


def test_only_a_server_s_early_answers_are_waited_for_here() -> None:
    pending: Future[int] = Future()
    wait_here(pending)  # another kind: left to whoever resolves it
    assert not pending.done()
    done = _answered()
    done.set_result(1)
    wait_here(done)

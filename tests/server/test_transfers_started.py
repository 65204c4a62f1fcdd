"""A GPU transfer naming a done flag, started on the server's socket thread (`Transfers.start`), with the engine's
steps, the registration's flags and the copy's handle stood in for: what is answered when, what the worker's rest
does, and that the registration, the lookup lock and the ordering of later requests come out right on every path.
The same path on a real GPU: tests/server/test_server_done_flags_gpu.py."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from kvferry.cache.steps import Enqueued
from kvferry.protocol.messages import ProtocolError, pack_ids
from kvferry.server import client_events
from kvferry.server import transfers as transfers_module
from kvferry.server.kv_mapping import MappedKV
from kvferry.server.requests import TransferArgs
from kvferry.server.sessions import Registration, SessionTable
from kvferry.server.transfers import Transfers
from kvferry.transfer import api as transfer_api


class Copy:
    """A copy in flight: done once `finish()` is called."""

    def __init__(self) -> None:
        self.ended = threading.Event()

    def done(self) -> bool:
        return self.ended.is_set()


class Flags:
    slots = 4

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.signals: list[tuple[Any, int, int]] = []

    def check_slot(self, slot: int) -> None:
        if slot >= self.slots:
            raise ProtocolError(transfers_module.ErrorCode.BAD_ARGUMENT, f"'done_slot'={slot}")

    def signal(self, handle: Any, slot: int, seq: int) -> None:
        if self.fail:
            raise RuntimeError("no stream memory operations here")
        self.signals.append((handle, slot, seq))

    def close(self) -> None:
        pass


class Engine:
    """Steps that stop at an enqueued copy (`final` as told), then wait for it and return the tokens."""

    def __init__(self, final: bool = True, fail_first: bool = False) -> None:
        self.final, self.fail_first = final, fail_first
        self.copy = Copy()
        self.finished = threading.Event()
        self.locks_ended: list[int | None] = []

    def _steps(self, tokens: Any, lock_id: int | None = None) -> Any:
        try:
            if self.fail_first:
                raise ValueError("block_ids has 1 entries, need 4")
            yield Enqueued(self.copy, len(tokens), self.final)
            self.copy.ended.wait(5)
            self.finished.set()
            return len(tokens)
        finally:
            self.locks_ended.append(lock_id)

    def store_steps(self, tokens: Any, *_: Any, **__: Any) -> Any:
        return self._steps(tokens)

    def retrieve_steps(self, tokens: Any, *_: Any, lock_id: int | None = None, **__: Any) -> Any:
        return self._steps(tokens, lock_id)


@pytest.fixture(autouse=True)
def _no_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfers_module, "_use_device", lambda device: None)


def setup(engine: Engine, flags: Flags | None) -> tuple[Transfers, SessionTable, Any, Registration]:
    table = SessionTable(time.monotonic)
    session = table.open(b"s" * 16, 1)
    kv = MappedKV(paged=[torch.zeros(1)], device=torch.device("cpu"), num_tensors=1, mapped_bytes=4, _regions=[])
    reg = Registration(7, kv, 1, 16, None, None, done_flags=flags)
    assert table.add_registration(session, reg)
    return Transfers(engine, table), table, session, reg  # type: ignore[arg-type]


def args(**extra: Any) -> TransferArgs:
    base = {"registration": 7, "tokens": pack_ids(list(range(64)), "tokens"), "block_ids": pack_ids([0, 1, 2, 3], "b")}
    return TransferArgs.model_validate({**base, **extra})


def test_a_flagged_store_is_answered_at_its_enqueue_and_finished_by_its_rest() -> None:
    engine, flags = Engine(), Flags()
    transfers, table, session, reg = setup(engine, flags)
    started = transfers.start(session, args(done_slot=2, done_seq=9), store=True, deadline=None, request_id=41)
    assert started is not None and started.answer == {"tokens": 64, "signalled": True}
    assert flags.signals == [(engine.copy, 2, 9)]  # the flag's write goes behind this copy
    assert reg.users == 1  # the registration stays mapped while the copy runs
    assert list(table._answered_early) == [(session.id, 41)]  # later requests wait for its bookkeeping
    result: list[dict[str, Any]] = []
    worker = threading.Thread(target=lambda: result.append(started.finish()))  # type: ignore[misc]
    worker.start()
    time.sleep(0.05)
    assert not engine.finished.is_set()  # the rest waits for the copy
    engine.copy.ended.set()
    worker.join(5)
    assert result == [{"tokens": 64, "signalled": False}] and reg.users == 0
    assert table._answered_early == {}


def test_a_request_after_a_copy_seen_done_carries_out_its_bookkeeping_once() -> None:
    engine = Engine()
    transfers, table, session, reg = setup(engine, Flags())
    started = transfers.start(session, args(done_slot=0, done_seq=1), store=True, deadline=None, request_id=1)
    assert started is not None and started.finish is not None
    table.settle()  # the copy still runs: nobody can have seen it done, nothing to do
    assert not engine.finished.is_set() and table._answered_early
    engine.copy.ended.set()  # the GPU is done; the client may have seen the flag and sent a LOOKUP
    began = time.monotonic()
    table.settle()  # no worker has come to it yet: the request's thread does it rather than wait
    assert time.monotonic() - began < 0.5 and engine.finished.is_set()
    assert table._answered_early == {} and reg.users == 0
    assert started.finish() == {"tokens": 64, "signalled": False}  # the worker, later: the same outcome
    assert engine.locks_ended == [None]  # the steps ran once


def test_a_request_waits_for_bookkeeping_a_worker_has_under_way() -> None:
    engine = Engine()
    transfers, table, session, _ = setup(engine, Flags())
    started = transfers.start(session, args(done_slot=0, done_seq=1), store=True, deadline=None, request_id=1)
    assert started is not None and started.finish is not None
    worker = threading.Thread(target=started.finish)
    worker.start()  # the worker waits for the copy inside the rest
    time.sleep(0.05)
    threading.Timer(0.1, engine.copy.ended.set).start()
    while not engine.copy.ended.is_set():
        time.sleep(0.001)
    table.settle()  # the worker holds the rest: waited for, not run again
    assert engine.finished.is_set() and engine.locks_ended == [None]
    worker.join(5)


def test_a_store_waiting_on_a_concurrent_store_is_answered_after_its_rest() -> None:
    engine = Engine(final=False)  # chunks in flight for another store of the prefix: the count is not final
    transfers, _, session, reg = setup(engine, flags := Flags())
    started = transfers.start(session, args(done_slot=0, done_seq=1), store=True, deadline=None, request_id=2)
    assert started is not None and started.answer is None and flags.signals == []
    engine.copy.ended.set()
    assert started.finish is not None and started.finish() == {"tokens": 64, "signalled": False}
    assert reg.users == 0


def test_a_flag_that_cannot_be_written_falls_back_to_answering_after_the_copy() -> None:
    engine = Engine()
    transfers, table, session, reg = setup(engine, Flags(fail=True))
    started = transfers.start(session, args(done_slot=0, done_seq=1), store=True, deadline=None, request_id=3)
    assert started is not None and started.answer is None
    engine.copy.ended.set()
    assert started.finish is not None and started.finish()["tokens"] == 64
    assert reg.users == 0
    table.settle()  # nothing answered early is left to wait for


def test_a_refused_or_failed_start_leaves_nothing_held() -> None:
    transfers, table, session, reg = setup(Engine(), None)
    with pytest.raises(ProtocolError, match="needs a CUDA registration"):
        transfers.start(session, args(done_slot=0, done_seq=1), store=True, deadline=None, request_id=4)
    assert reg.users == 0
    engine = Engine(fail_first=True)
    transfers, table, session, reg = setup(engine, Flags())
    table.add_lock(session, 55)
    with pytest.raises(ValueError, match="block_ids"):
        transfers.start(session, args(done_slot=0, done_seq=1, lock=55), store=False, deadline=None, request_id=5)
    assert reg.users == 0 and engine.locks_ended == [55]  # the steps ended the lock they were given
    with pytest.raises(ProtocolError, match="'done_slot'=9"):
        transfers.start(session, args(done_slot=9, done_seq=1), store=True, deadline=None, request_id=6)
    assert reg.users == 0
    assert transfers.start(session, args(), store=True, deadline=None, request_id=7) is None  # no flag: a worker's


class OrderSeen(Engine):
    """Steps that note the event the transfers they would enqueue are ordered after, at the copy and at the rest."""

    def __init__(self, final: bool) -> None:
        super().__init__(final=final)
        self.seen: list[int | None] = []

    def _steps(self, tokens: Any, lock_id: int | None = None) -> Any:
        self.seen.append(getattr(transfer_api._order, "event", None))
        yield Enqueued(self.copy, len(tokens), self.final)
        self.seen.append(getattr(transfer_api._order, "event", None))
        return len(tokens)


@pytest.mark.parametrize("store", [True, False], ids=["store", "retrieve"])
@pytest.mark.parametrize("final", [True, False])
def test_a_transfer_waits_for_its_ready_event_on_the_gpu_and_leaves_the_thread_as_it_was(
    final: bool, store: bool
) -> None:
    """A STORE or RETRIEVE naming a ready slot orders its copies after that slot's event, when started on the socket
    thread and when its rest runs on a worker (a copy of chunks a concurrent store gave up); the thread's order is
    put back after each. A transfer naming no slot waits for no event (the thread's stream, as in process)."""
    engine = OrderSeen(final)
    transfers, _, session, reg = setup(engine, Flags())
    reg.ready = client_events.ClientEvents(("event-0", "event-1"), (50, 51))
    started = transfers.start(session, args(done_slot=0, done_seq=1, ready_slot=1), store=store, deadline=None,
                              request_id=1)  # fmt: skip
    assert started is not None and started.finish is not None
    assert getattr(transfer_api._order, "event", None) is None
    engine.copy.ended.set()
    started.finish()
    assert engine.seen == [51, 51]
    assert getattr(transfer_api._order, "event", None) is None
    engine.seen.clear()
    assert transfers.run(session, args(ready_slot=0), store=store, deadline=None)["tokens"] == 64
    assert transfers.run(session, args(), store=store, deadline=None)["tokens"] == 64
    assert engine.seen == [50, 50, None, None]
    assert getattr(transfer_api._order, "event", None) is None


class OpenedEvent:
    """A client's own ready event as the server opens it (`open_client_event`), its raw handle made up."""

    def __init__(self, handle: bytes) -> None:
        self.cuda_event = int.from_bytes(handle[:2], "little")


@pytest.mark.parametrize("store", [True, False], ids=["store", "retrieve"])
def test_a_transfer_with_an_event_of_its_own_waits_for_it_on_the_gpu(
    monkeypatch: pytest.MonkeyPatch, store: bool
) -> None:
    """Every event of the ring in use: the transfer sends one of its own, opened for it. It runs on a worker
    (answered after its copy), and its copies wait for that event on the GPU, not a thread for the event."""
    opened: list[bytes] = []

    def open_event(device: Any, handle: bytes) -> OpenedEvent:
        opened.append(handle)
        return OpenedEvent(handle)

    monkeypatch.setattr(transfers_module, "open_client_event", open_event)
    engine = OrderSeen(final=True)
    engine.copy.ended.set()
    transfers, _, session, _ = setup(engine, Flags())
    own = args(done_slot=0, done_seq=1, ready_event=(777).to_bytes(2, "little") + bytes(62))
    assert transfers.start(session, own, store=store, deadline=None, request_id=1) is None  # a worker's
    assert transfers.run(session, own, store=store, deadline=None) == {"tokens": 64, "signalled": False}
    assert engine.seen == [777, 777] and len(opened) == 1
    assert getattr(transfer_api._order, "event", None) is None


def test_a_retrieve_naming_a_slot_or_event_it_cannot_have_is_refused_and_keeps_its_lock() -> None:
    """A slot past the registration's ring, or an event of a registration that is not on a GPU: refused by name
    before anything is copied; the lookup lock it named stays the session's (to free or to retrieve with)."""
    engine = OrderSeen(final=True)
    transfers, table, session, reg = setup(engine, Flags())
    reg.ready = client_events.ClientEvents(("event-0", "event-1"), (50, 51))
    table.add_lock(session, 55)
    with pytest.raises(ProtocolError, match="'ready_slot'=2, but the registration has 2 events"):
        transfers.start(session, args(done_slot=0, done_seq=1, ready_slot=2, lock=55), store=False, deadline=None,
                        request_id=1)  # fmt: skip
    with pytest.raises(ProtocolError, match="'ready_slot'=2, but the registration has 2 events"):
        transfers.run(session, args(ready_slot=2, lock=55), store=False, deadline=None)
    with pytest.raises(ProtocolError, match="'ready_event' is only meaningful for a CUDA registration"):
        transfers.run(session, args(ready_event=bytes(64), lock=55), store=False, deadline=None)
    assert engine.seen == [] and reg.users == 0
    assert transfers.run(session, args(lock=55), store=False, deadline=None)["tokens"] == 64  # the lock was kept

"""Done flags, the client half (a word per transfer in shared memory, polled), and the server's refusals of them
where they cannot work. The GPU writing them: tests/server/test_server_done_flags_gpu.py."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from kvferry.client import KvferryClient, ServerError, ServerUnavailable, done_flags
from kvferry.client.done_flags import DoneFlags, FlagFuture, FlagWatch
from kvferry.client.records import GpuRegistration
from kvferry.protocol.messages import Op, pack_ids
from tests.server.serverkit import FakeEngine, random_kv

FMT = 3  # NL_X_NB_BS_HS: what the fake engine copies
NS = {"model": "fake-model"}


def write_later(flags: DoneFlags, slot: int, value: int, after_s: float) -> threading.Thread:
    def write() -> None:
        time.sleep(after_s)
        flags._words[slot] = value  # what the server's GPU does through its own mapping of the page

    thread = threading.Thread(target=write)
    thread.start()
    return thread


def test_slots_are_shared_memory_and_reused_only_when_given_back() -> None:
    flags = DoneFlags(slots=3)
    assert flags._words.is_shared() and flags.descriptor["kind"] == "shm_fd"
    taken = [flags.take() for _ in range(3)]
    assert sorted(slot for slot, _ in taken) == [0, 1, 2]  # type: ignore[misc]
    assert all(seq == 1 for _, seq in taken)  # type: ignore[misc]
    assert flags.take() is None  # every slot held: the request goes without a flag
    slot, seq = taken[0]  # type: ignore[misc]
    assert not flags.is_set(slot, seq)
    flags._words[slot] = seq
    assert flags.is_set(slot, seq)
    flags.release(slot)
    again = flags.take()
    assert again == (slot, seq + 1)  # the old number in the word cannot pass for the new request's
    assert not flags.is_set(*again)


def test_wait_returns_when_the_word_shows_and_not_before() -> None:
    flags = DoneFlags(slots=2)
    slot, seq = flags.take()  # type: ignore[misc]
    flags._words[slot] = seq + 5  # another number (a stale write) is not this request's
    writer = write_later(flags, slot, seq, after_s=0.05)
    started = time.monotonic()
    flags.wait(slot, seq, time.monotonic() + 30, lambda: None, spin_s=0.01)  # a TimeoutError: it missed the word
    assert time.monotonic() - started > 0.04
    writer.join()


def test_wait_gives_up_at_its_deadline_and_when_the_server_is_gone() -> None:
    flags = DoneFlags(slots=2)
    slot, seq = flags.take()  # type: ignore[misc]
    with pytest.raises(TimeoutError):
        flags.wait(slot, seq, time.monotonic() + 0.05, lambda: None)

    def gone() -> None:
        raise ConnectionError("server gone")

    with pytest.raises(ConnectionError, match="server gone"):
        flags.wait(slot, seq, time.monotonic() + 5, gone)


def test_a_copy_a_lost_server_still_finishes_counts_and_one_that_does_not_fails_after_the_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(done_flags, "LOST_DRAIN_S", 0.3)
    flags = DoneFlags(slots=4)

    def gone() -> None:
        raise ConnectionError("server gone")

    slot, seq = flags.take()  # type: ignore[misc]
    writer = write_later(flags, slot, seq, after_s=0.1)  # the torn-down server's queued copy ends after all
    flags.wait(slot, seq, time.monotonic() + 5, gone)
    writer.join()
    slot, seq = flags.take()  # type: ignore[misc]
    started = time.monotonic()
    with pytest.raises(ConnectionError, match="server gone"):
        flags.wait(slot, seq, time.monotonic() + 5, gone)
    assert 0.3 <= time.monotonic() - started < 2
    watch = FlagWatch(gone)
    try:
        finished: Future[Any] = Future()
        slot, seq = flags.take()  # type: ignore[misc]
        watch.watch(flags, slot, seq, finished, "done", time.monotonic() + 5)
        writer = write_later(flags, slot, seq, after_s=0.1)
        assert finished.result(timeout=5) == "done"
        writer.join()
        failed: Future[Any] = Future()
        slot, seq = flags.take()  # type: ignore[misc]
        started = time.monotonic()
        watch.watch(flags, slot, seq, failed, "done", time.monotonic() + 5)
        with pytest.raises(ConnectionError, match="server gone"):
            failed.result(timeout=5)
        assert 0.3 <= time.monotonic() - started < 2
    finally:
        watch.close(time.monotonic() + 5)


def test_flag_watch_resolves_futures_as_their_words_show() -> None:
    flags = DoneFlags(slots=4)
    watch = FlagWatch(lambda: None)
    try:
        futures: list[Future[Any]] = []
        writers = []
        for i in range(3):
            slot, seq = flags.take()  # type: ignore[misc]
            future: Future[Any] = Future()
            watch.watch(flags, slot, seq, future, f"done {i}", time.monotonic() + 5)
            futures.append(future)
            writers.append(write_later(flags, slot, seq, after_s=0.02 * (3 - i)))
        assert [f.result(timeout=5) for f in futures] == ["done 0", "done 1", "done 2"]
        assert len(flags._free) == 4  # every slot back once seen
        for writer in writers:
            writer.join()
    finally:
        watch.close(time.monotonic() + 5)


def test_a_waiter_sees_the_flag_itself_and_the_watch_then_lets_it_go() -> None:
    flags = DoneFlags(slots=2)
    watch = FlagWatch(lambda: None)
    watch._run = lambda: None  # type: ignore[method-assign]  # a watch thread that never looks: only the waiter does
    try:
        outcome = FlagFuture()
        slot, seq = flags.take()  # type: ignore[misc]
        outcome.answered(watch.watch(flags, slot, seq, outcome, "done", time.monotonic() + 5))
        assert outcome.cancel() is False
        writer = write_later(flags, slot, seq, after_s=0.005)
        assert outcome.result() == "done"  # seen on this thread
        writer.join()
        assert sorted(flags._free) == [0, 1]  # its slot given back, once
        watch._items[0].settle(None)  # the watch thread seeing it later changes nothing
        assert sorted(flags._free) == [0, 1]
    finally:
        watch.close(time.monotonic() + 5)


def test_a_flag_future_says_its_copy_ended_as_the_word_shows_before_it_resolves() -> None:
    flags = DoneFlags(slots=2)
    watch = FlagWatch(lambda: None)
    watch._run = lambda: None  # type: ignore[method-assign]  # a watch thread that never looks
    try:
        outcome = FlagFuture()
        slot, seq = flags.take()  # type: ignore[misc]
        assert not outcome.copied()  # no answer yet
        outcome.answered(watch.watch(flags, slot, seq, outcome, 64, time.monotonic() + 5))
        assert not outcome.copied()
        write_later(flags, slot, seq, after_s=0).join()
        assert outcome.copied() and not outcome.done()  # the copy has ended; nothing has resolved it yet
        answered_after = FlagFuture()
        answered_after.set_result(64)
        answered_after.answered(None)
        assert not answered_after.copied()  # no flag: its answer came after the copy, and resolved it
    finally:
        watch.close(time.monotonic() + 5)


def test_a_waiter_with_a_timeout_or_past_its_look_leaves_the_flag_to_the_watch() -> None:
    flags = DoneFlags(slots=2)
    watch = FlagWatch(lambda: None)
    try:
        outcome = FlagFuture()
        slot, seq = flags.take()  # type: ignore[misc]
        outcome.answered(watch.watch(flags, slot, seq, outcome, 7, time.monotonic() + 5))
        writer = write_later(flags, slot, seq, after_s=0.1)  # after the waiter's look (20 ms)
        assert outcome.result() == 7  # resolved by the watch thread
        writer.join()
        unanswered = FlagFuture()
        with pytest.raises(TimeoutError):
            unanswered.result(timeout=0.01)  # no answer yet: a waiter with a timeout does not wait for one
        unanswered.set_result(1)
        unanswered.answered(None)
        assert unanswered.result() == 1
    finally:
        watch.close(time.monotonic() + 5)


def test_flag_watch_fails_late_and_orphaned_transfers_and_keeps_their_slots() -> None:
    flags = DoneFlags(slots=4)
    up = [True]

    def check() -> None:
        if not up[0]:
            raise ConnectionError("server gone")

    watch = FlagWatch(check)
    late: Future[Any] = Future()
    slot, seq = flags.take()  # type: ignore[misc]
    watch.watch(flags, slot, seq, late, 1, time.monotonic() + 0.05)
    with pytest.raises(TimeoutError):
        late.result(timeout=5)
    orphan: Future[Any] = Future()
    slot2, seq2 = flags.take()  # type: ignore[misc]
    watch.watch(flags, slot2, seq2, orphan, 1, time.monotonic() + 5)
    up[0] = False
    with pytest.raises(ConnectionError):
        orphan.result(timeout=5)
    pending: Future[Any] = Future()
    up[0] = True
    slot3, seq3 = flags.take()  # type: ignore[misc]
    watch.watch(flags, slot3, seq3, pending, 1, time.monotonic() + 5)
    watch.close(time.monotonic() + 5)
    with pytest.raises(ConnectionError, match="closed"):
        pending.result(timeout=5)
    assert sorted(flags._free) == [s for s in range(4) if s not in (slot, slot2, slot3)]  # the server may still write


def test_the_server_refuses_done_flags_where_no_gpu_writes_them(client: KvferryClient) -> None:
    kv = random_kv(5)
    reg = client.register_kv_cache(kv, FMT, namespace=NS)
    base = {
        "registration": reg,
        "tokens": pack_ids(list(range(8)), "tokens"),
        "block_ids": pack_ids([0, 1, 2, 3], "block_ids"),
    }
    with pytest.raises(ServerError, match="CUDA registration"):
        client._call(lambda: client._conn.submit(Op.STORE, {**base, "done_slot": 0, "done_seq": 1}))
    with pytest.raises(ServerError, match="both 'done_slot' and 'done_seq'"):
        client._call(lambda: client._conn.submit(Op.RETRIEVE, {**base, "done_slot": 0}))
    flags = DoneFlags()
    args = {"format": FMT, "namespace": dict(NS), "storages": [flags.descriptor], "kv": {"storage": 0, "offset": 0,
            "shape": [4], "stride": [1], "dtype": "float32"}, "done_flags": flags.descriptor}  # fmt: skip
    with pytest.raises(ServerError, match="only meaningful for a CUDA registration"):
        client._call(lambda: client._conn.submit(Op.REGISTER_KV_CACHE, args))
    assert client.store(reg, list(range(8)), [0, 1, 2, 3]) == 8  # the session is fine


class _Copy:
    def __init__(self, done: bool) -> None:
        self._done = done

    def done(self) -> bool:
        return self._done


def test_a_request_settles_the_bookkeeping_of_copies_seen_done_by_any_session() -> None:
    from kvferry.server.sessions import SessionTable

    table = SessionTable(time.monotonic)
    a, b = table.open(b"a" * 16, 1), table.open(b"b" * 16, 2)
    settled: list[tuple[str, float]] = []
    table.answering_early(a, 1, _Copy(done=True), lambda t: settled.append(("a", t)))  # its client may have seen it
    table.answering_early(b, 7, _Copy(done=False), lambda t: settled.append(("b", t)))  # copying: nobody has seen it
    table.settle(0.5)
    assert settled == [("a", 0.5)]  # a's bookkeeping, done or waited for; never b's
    table.answered(a, 1)
    table.answered(b, 7)
    table.settle()
    assert settled == [("a", 0.5)]  # nothing answered early is left


def test_a_gpu_transfer_whose_server_is_lost_fails_only_once_its_copy_can_no_longer_run(
    server: Any, endpoint: str, engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torn-down server may still carry out a copy it had queued (kvferry.client.done_flags): a GPU transfer sent
    to a server that is then lost fails LOST_DRAIN_S later, not at once, so the engine does not reuse its blocks
    under that copy. A CPU transfer (the server's own process copies) fails at once."""
    from kvferry.client import transfers
    from kvferry.client.link import DOWN

    monkeypatch.setattr(transfers, "LOST_DRAIN_S", 0.3)
    with KvferryClient(endpoint, timeout_s=10) as client:
        reg = client.register_kv_cache(random_kv(6), FMT, namespace=NS)
        assert client.store(reg, list(range(8)), [0, 1, 2, 3]) == 8
        for as_gpu in (False, True):
            if as_gpu:  # retrieves are answered after their copy: no flag to watch, only the grace
                stand_in_gpu_registration(server, client, reg)
            for call in ("async", "sync"):
                engine.retrieve_gate.clear()  # the server's copy holds
                engine.in_transfer.clear()
                outcome: Future[Any] = Future()
                if call == "async":
                    outcome = client.retrieve_async(reg, list(range(8)), [4, 5, 6, 7])
                else:

                    def run(into: Future[Any] = outcome) -> None:
                        try:
                            into.set_result(client.retrieve(reg, list(range(8)), [4, 5, 6, 7]))
                        except Exception as exc:
                            into.set_exception(exc)

                    threading.Thread(target=run).start()
                assert engine.in_transfer.wait(5)
                lost = time.monotonic()
                client._conn.set_state(DOWN, "lost in a test")
                with pytest.raises(ServerUnavailable):
                    outcome.result(timeout=5)
                waited = time.monotonic() - lost
                assert (waited >= 0.29) if as_gpu else (waited < 0.25), (call, as_gpu, waited)
                engine.retrieve_gate.set()
                assert client._conn.wait_available(5)


def test_a_transfer_that_was_never_sent_gives_its_flag_slot_back(
    client: KvferryClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the server is unreachable a request fails at once, unsent: its slot is free again (the server cannot
    write what it never got), unlike one that timed out after it was sent."""
    from kvferry.client.link import DOWN, Link

    reg = client.register_kv_cache(random_kv(6), FMT, namespace=NS)
    flags = DoneFlags(slots=2)  # as a GPU registration holds (the fake engine is CPU)
    client._gpu[reg] = GpuRegistration(torch.device("cuda"), FakeRing(), flags)
    monkeypatch.setattr(Link, "probe", lambda self: None)  # it stays unreachable for the test
    client._conn.set_state(DOWN, "test: the server went away")
    for _ in range(5):
        with pytest.raises(ConnectionError):
            client.store(reg, list(range(8)), [0, 1, 2, 3])
        with pytest.raises(ConnectionError):
            client.retrieve_async(reg, list(range(8)), [0, 1, 2, 3])
    assert sorted(flags._free) == [0, 1]


def test_requests_about_registrations_and_counts_settle_transfers_seen_done_first() -> None:
    """A client that saw its transfer's flag, then prefetches, asks for the counts, ends its session or unregisters,
    finds the transfer's effects there: the chunks it stored in the pool, the registration it held released."""
    from kvferry.protocol.messages import ProtocolError
    from kvferry.server.handlers import RequestHandlers
    from kvferry.server.requests import NoArgs, PrefetchArgs, RegistrationArgs
    from kvferry.server.sessions import SessionTable

    table = SessionTable(time.monotonic)
    session = table.open(b"a" * 16, 1)
    settled: list[float] = []
    table.answering_early(session, 1, _Copy(done=True), settled.append)  # left answered-early: settles every time
    ended: list[str] = []
    handlers = RequestHandlers(
        FakeEngine(),
        table,
        hello={},
        end_session=lambda session_id, reason: ended.append(reason) or {},
        server_stats=lambda: {"settled": len(settled)},
    )
    key_space = {"model": "m", "kv_dtype": "bfloat16", "layout": "fake:3"}
    handlers.run(Op.PREFETCH, session, PrefetchArgs(tokens=pack_ids(list(range(8)), "t"), namespace=key_space), None)
    assert len(settled) == 1
    assert handlers.run(Op.STATS, session, NoArgs(), None)["server"] == {"settled": 2}
    handlers.run(Op.END_SESSION, session, NoArgs(), None)
    assert (len(settled), ended) == (3, ["end_session"])
    with pytest.raises(ProtocolError, match="is not registered by this session"):
        handlers.run(Op.UNREGISTER_KV_CACHE, session, RegistrationArgs(registration=5), None)
    assert len(settled) == 4


def stand_in_gpu_registration(server: Any, client: KvferryClient, reg: int) -> FakeRing:
    """Make `reg` (CPU KV on the fake engine) a GPU registration without done flags to both ends: the client keeps a
    ring of ready events (`FakeRing`) and sends slot 0 with every transfer, the server holds one stand-in event for
    that slot (the fake engine copies on the CPU and orders nothing after it). Its transfers are answered after
    their copy."""
    from kvferry.server.client_events import ClientEvents

    ring = FakeRing()
    client._gpu[reg] = GpuRegistration(torch.device("cuda"), ring, None)
    server._sessions._sessions[client.session_id].registrations[reg].ready = ClientEvents(("stand-in",), (0,))
    return ring


class FakeRing:
    """Stands in for a GPU registration's ring of ready events (the fake engine is CPU): every transfer gets slot 0."""

    def __init__(self) -> None:
        self.held = 0  # slots recorded and not given back
        self.recorded = 0

    def record(self) -> int:
        self.held += 1
        self.recorded += 1
        return 0

    def release(self, slot: int) -> None:
        self.held -= 1


def test_a_gpu_registrations_stores_and_retrieves_each_name_a_ready_event(
    server: Any, client: KvferryClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both directions are ordered after the client's stream: each STORE and RETRIEVE of GPU KV records a slot of the
    ring right before it is sent, names it, and gives it back once answered."""
    reg = client.register_kv_cache(random_kv(6), FMT, namespace=NS)
    ring = stand_in_gpu_registration(server, client, reg)
    sent: list[tuple[Op, Any]] = []
    submit = client._conn.submit
    monkeypatch.setattr(client._conn, "submit", lambda op, args, *a, **k: sent.append((op, args.get("ready_slot"))) or
                        submit(op, args, *a, **k))  # fmt: skip
    assert client.store(reg, list(range(8)), [0, 1, 2, 3]) == 8
    assert client.store_async(reg, list(range(8)), [0, 1, 2, 3]).result(timeout=10) == 8
    assert client.retrieve(reg, list(range(8)), [4, 5, 6, 7]) == 8
    assert client.retrieve_async(reg, list(range(8)), [4, 5, 6, 7]).result(timeout=10) == 8
    assert sent == [(Op.STORE, 0), (Op.STORE, 0), (Op.RETRIEVE, 0), (Op.RETRIEVE, 0)]
    assert (ring.recorded, ring.held) == (4, 0)


def test_ending_the_session_forgets_every_gpu_registration(client: KvferryClient) -> None:
    """Registrations of a session the client ended are gone with everything kept for them (their done flags too):
    the server may hand the same ids out again."""
    reg = client.register_kv_cache(random_kv(6), FMT, namespace=NS)
    client._gpu[reg] = GpuRegistration(torch.device("cuda"), FakeRing(), DoneFlags(slots=2))
    client.end_session()
    assert client._gpu == {} and client._transfers.flags(reg) is None


def _resolved_in_thread(resolve: Any) -> bool:
    """Whether `resolve()` returned within 10 s on a thread of its own (False: it hung)."""
    thread = threading.Thread(target=resolve, daemon=True)
    thread.start()
    thread.join(10)
    return not thread.is_alive()


def test_done_callbacks_may_ask_a_flag_future_for_its_result() -> None:
    """A future's done callbacks run on the thread resolving it, before the answer is marked handled: a callback
    that asks for the result (as `plus`, or a server link's outage check, does) gets it rather than waiting for
    the answer it is part of."""
    seen: list[Any] = []
    outcome = FlagFuture()
    outcome.add_done_callback(lambda done: seen.append((done.exception(), done.result())))
    assert _resolved_in_thread(lambda: outcome.set_result(8))
    failed = FlagFuture()
    failed.add_done_callback(lambda done: seen.append(type(done.exception()).__name__))
    assert _resolved_in_thread(lambda: failed.set_exception(ConnectionError("gone")))
    assert seen == [(None, 8), "ConnectionError"]


def test_an_asynchronous_store_answered_after_its_copy_resolves_with_callbacks_that_read_it(
    client: KvferryClient,
) -> None:
    reg = client.register_kv_cache(random_kv(7), FMT, namespace=NS)
    seen: list[Any] = []
    stored = client.store_async(reg, list(range(8)), [0, 1, 2, 3])  # CPU KV: answered after the copy, no flag
    stored.add_done_callback(lambda done: seen.append(done.result()))
    assert stored.result(timeout=10) == 8
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [8]
    assert client.retrieve_async(reg, list(range(8)), [4, 5, 6, 7]).exception(timeout=10) is None

"""The client half of done flags (see `kvferry.server.done_signal`): a page of words the server's GPU writes.

A GPU registration shares one page of shared memory with the server. A STORE or RETRIEVE takes a free word (a
slot) and the slot's next sequence number; the server answers once the copy is enqueued and has the GPU write the
number into the word once the copy is done. Reading the word is a load from memory: no driver call, no socket.

A slot is reused only after its number was seen, so a word never holds a number a later request could mistake for
its own. A request that ends without its number seen (a timeout, the server lost) keeps its slot out of use: the
server may still write it. With every slot out of use a request is answered after its copy, as without flags.

A server lost with a copy enqueued may still carry it out: on the H200 a server SIGKILLed mid-copy
had its queued copy and flag write completed as its process was torn down, after its socket had closed. So the
flag is watched for `LOST_DRAIN_S` more once the server is lost: shown, the transfer succeeded (the write is
ordered after the copy: every byte is there); not shown, it fails, and its blocks are the engine's again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from kvferry.client.kv_export import export_kv
from kvferry.futures import HelpedFuture
from kvferry.stopping import join_thread

SLOTS = 64
LOST_DRAIN_S = 1.0  # a lost server's copy in flight ends within this (a 16-chunk llama3-8b copy takes ~10 ms)
LOOK_S = 0.02  # how long a waiter of a `FlagFuture` looks at its flag itself before leaving it to the watch thread
_PAGE_WORDS = 1024  # one 4 KiB page: what the server registers with the driver


class DoneFlags:
    """One registration's flag words and which slots requests hold."""

    def __init__(self, slots: int = SLOTS) -> None:
        words = torch.zeros(max(_PAGE_WORDS, slots), dtype=torch.int32)
        storages, _ = export_kv(words)  # into shared memory, in place
        self.descriptor: dict[str, Any] = storages[0]
        self._words = words
        self._view = words.numpy()  # a plain load per look: the GPU writes the page behind numpy's back
        self._seq = [0] * slots
        self._free = list(range(slots))
        self._lock = threading.Lock()

    def take(self) -> tuple[int, int] | None:
        """A free slot and the number the server is to write into it, or None when none is free."""
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
            self._seq[slot] = self._seq[slot] % (2**31 - 1) + 1
            return slot, self._seq[slot]

    def is_set(self, slot: int, seq: int) -> bool:
        return int(self._view[slot]) == seq

    def release(self, slot: int) -> None:
        """Give back a slot whose number was seen, or that the server refused before enqueueing anything."""
        with self._lock:
            self._free.append(slot)

    def wait(self, slot: int, seq: int, deadline: float, check: Callable[[], None], spin_s: float = 0.02) -> None:
        """Return once word `slot` holds `seq`. Polls: yielding the CPU (and the GIL) between looks for `spin_s`,
        then sleeping 50 us between looks; `check()` raises when waiting is pointless (the server is gone), and
        TimeoutError at `deadline` (time.monotonic())."""
        spin_until = time.monotonic() + spin_s
        view = self._view
        lost: _Lost | None = None
        while int(view[slot]) != seq:
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError("the transfer was enqueued but did not finish before the client's timeout")
            lost = _check(check, lost, now)
            time.sleep(0 if now < spin_until else 50e-6)


def take_slot(flags: DoneFlags | None, args: dict[str, Any]) -> int | None:
    """Take a free word of `flags` for a transfer: its slot and sequence number go into the request's `args`. None
    (the server answers after the copy) without flags or with every word in use."""
    taken = flags.take() if flags is not None else None
    if taken is None:
        return None
    args["done_slot"], args["done_seq"] = taken
    return taken[0]


def release_slot(flags: DoneFlags | None, slot: int | None) -> None:
    if flags is not None and slot is not None:
        flags.release(slot)


@dataclass(frozen=True, slots=True)
class _Lost:
    """The server was found lost (`error`); its copy may still end until `until` (time.monotonic())."""

    error: Exception
    until: float


def _check(check: Callable[[], None], lost: _Lost | None, now: float) -> _Lost | None:
    """`check()` while the server is up; once lost, the error again after `LOST_DRAIN_S` (see the module)."""
    if lost is None:
        try:
            check()
        except Exception as exc:
            return _Lost(exc, now + LOST_DRAIN_S)
        return None
    if now > lost.until:
        raise lost.error
    return lost


@dataclass(slots=True)
class _Watched:
    flags: DoneFlags
    slot: int
    seq: int
    future: Future[Any]
    value: Any
    deadline: float
    lost: _Lost | None = None
    claim: threading.Lock = field(default_factory=threading.Lock)

    def settle(self, error: BaseException | None) -> None:
        """Resolve the future (its slot given back when the flag was seen), once: the watch thread and a waiter
        of a `FlagFuture` may both get here."""
        if not self.claim.acquire(blocking=False):
            return
        if error is None:
            self.flags.release(self.slot)
            self.future.set_result(self.value)
        else:
            self.future.set_exception(error)


class FlagFuture(HelpedFuture[Any]):
    """An asynchronous transfer's outcome, resolved by its done flag: by the watch thread (`FlagWatch`), or by a
    thread that waits for it (`kvferry.futures`), which looks at the flag itself for a while once the server's
    answer is in."""

    def __init__(self) -> None:
        super().__init__()
        self._watched: _Watched | None = None
        self._answered = threading.Event()

    def answered(self, watched: _Watched | None) -> None:
        """The server's answer was handled: `watched` is the flag being watched, or None (resolved otherwise)."""
        self._watched = watched
        self._answered.set()

    def copied(self) -> bool:
        """Whether the flag shows: the server's copy has ended, and the watch thread resolves the future just after.
        False before the server's answer is in, and for a transfer answered after its copy (done on its answer)."""
        item = self._watched
        return item is not None and item.flags.is_set(item.slot, item.seq)

    def _help(self) -> None:
        """Look at the flag, yielding the CPU between looks, for up to `LOOK_S` (then wait for the watch thread,
        which also tells a lost server and a timeout)."""
        self._answered.wait()  # the connection answers or fails every request (its own timeout included)
        item = self._watched
        if item is None:
            return
        until = time.monotonic() + LOOK_S
        while not self.done():
            if item.flags.is_set(item.slot, item.seq):
                item.settle(None)
                return
            if time.monotonic() > until:
                return
            time.sleep(0)


class FlagWatch:
    """Resolves the futures of asynchronous transfers answered early, once their flags show: one thread per client,
    started on first use, polling every 50 us while any is outstanding and idle otherwise."""

    def __init__(self, check: Callable[[], None]) -> None:
        self._check = check
        self._items: list[_Watched] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(
        self, flags: DoneFlags, slot: int, seq: int, future: Future[Any], value: Any, deadline: float
    ) -> _Watched | None:
        """Set `future` to `value` once word `slot` holds `seq` (TimeoutError at `deadline`); what is watched (None:
        the client is closed, the future failed)."""
        with self._cond:
            if self._closed:
                future.set_exception(ConnectionError("the client was closed before the transfer finished"))
                return None
            item = _Watched(flags, slot, seq, future, value, deadline)
            self._items.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvferry-flags", daemon=True)
                self._thread.start()
            self._cond.notify()
        return item

    def close(self, deadline: float) -> None:
        """Stop watching; the thread (a daemon) is waited for until `deadline` (it may be running a callback)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            join_thread(thread, deadline)
        for item in self._items:  # their slots stay out of use: the server may still write them
            item.settle(ConnectionError("the client was closed before the transfer finished"))
        self._items.clear()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                items = list(self._items)
            now = time.monotonic()
            finished: list[tuple[_Watched, BaseException | None]] = []
            for item in items:
                if item.future.done() or item.flags.is_set(item.slot, item.seq):  # done: a waiter saw the flag
                    finished.append((item, None))
                elif now > item.deadline:
                    finished.append((item, TimeoutError("the transfer did not finish before the client's timeout")))
                else:
                    try:
                        item.lost = _check(self._check, item.lost, now)
                    except Exception as exc:  # the server is gone, and its copy did not end after all
                        finished.append((item, exc))
            if finished:
                with self._cond:
                    done = {id(item) for item, _ in finished}
                    self._items = [item for item in self._items if id(item) not in done]
                for item, error in finished:
                    item.settle(error)
            else:
                time.sleep(50e-6)

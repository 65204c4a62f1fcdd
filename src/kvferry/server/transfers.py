"""STORE and RETRIEVE: their checks, a GPU transfer's order after the client's own work, and the two ways one runs.

A GPU transfer's copies wait, on the GPU, for the ready event the client recorded on its stream right before
sending it: a STORE reads the blocks after the work that writes them, a RETRIEVE writes them after the work queued
on them (no CPU thread of the server waits for the engine's GPU work).

- On a worker, start to end, answered after the copy: CPU KV (the copy is the CPU's own work), a GPU transfer that
  names no done flag, and one whose ready event is one of its own (opened for it, not one of the ring's).
- Started on the socket thread: a GPU transfer naming a done flag (`kvferry.server.done_signal`). The thread runs
  it up to its copy being enqueued, answers at once, and leaves the wait and the bookkeeping to a worker. On the
  GPU host a hand-over between threads costs ~100-200 us of wake-up:
  this path has none before the copy starts and none before the answer leaves. The rest runs once (`FinishOnce`):
  on that worker, or on the socket thread when a later request must see its effects first and the copy has ended
  (`SessionTable.settle`) -- rather than the socket thread waiting for the worker to wake up.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from kvferry.cache.page_keys import KeyedPages
from kvferry.cache.steps import Finished, Steps, finish_steps, first_step, run_steps
from kvferry.protocol.messages import ErrorCode, ProtocolError, unpack_ids
from kvferry.server.cache_service import CacheTransfers
from kvferry.server.client_events import open_client_event
from kvferry.server.requests import TransferArgs
from kvferry.server.sessions import Registration, Session, SessionTable
from kvferry.transfer import ordered_after

log = logging.getLogger("kvferry.server")


class Started(NamedTuple):
    """A transfer started on the socket thread: the result to send now (None: `finish`'s, when it returns), and
    the rest of it for a worker (None: nothing is left). A tuple: made for every such transfer, before its answer
    leaves, and a frozen dataclass is several times slower to make."""

    answer: dict[str, Any] | None
    finish: Callable[[], dict[str, Any]] | None


class FinishOnce:
    """The rest of a transfer answered early, run once by whichever thread comes first: its worker (`__call__`: the
    result, or the exception it raised), or a request that must see its effects (`settle`: waits for nothing but
    a run in progress, raises nothing).

    One lock does both jobs: whoever takes it first runs the rest, holding it; a later comer waits by taking it
    and finds the rest done. (A lock and an Event, a Condition over another lock, took ~2 us of the socket thread
    per transfer before its answer left, against ~0.1 us; CPU machine.)"""

    __slots__ = ("_lock", "_outcome", "_ran", "_rest")

    def __init__(self, rest: Callable[[], dict[str, Any]]) -> None:
        self._rest = rest
        self._lock = threading.Lock()
        self._ran = False
        self._outcome: Any = None

    def __call__(self) -> dict[str, Any]:
        self._run_or_wait(None)
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return self._outcome

    def settle(self, timeout_s: float) -> None:
        self._run_or_wait(timeout_s)

    def _run_or_wait(self, timeout_s: float | None) -> None:
        if not self._lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
            return  # a run still under way after `timeout_s`: left to it
        try:
            if not self._ran:
                self._ran = True
                try:
                    self._outcome = self._rest()
                except Exception as exc:
                    self._outcome = exc
        finally:
            self._lock.release()


class Transfers:
    def __init__(self, engine: CacheTransfers, sessions: SessionTable) -> None:
        self._engine = engine
        self._sessions = sessions

    def run(self, session: Session, args: TransferArgs, *, store: bool, deadline: float | None) -> dict[str, Any]:
        """The whole transfer on this thread (a worker); its result once the copy is done."""
        tokens, block_ids = _ids(args, store, self._engine)
        if not store:
            self._sessions.settle()  # stores seen done are hits
        reg = self._sessions.use_registration(session, args.registration)
        try:
            _check_ready_slot(reg, args)
            after_client = _after_client_work(reg, args)  # opens an event of its own: refused before the lock is
            self._take_lock(session, args)  # from here the engine owns it: a retrieve ends it however it goes
            with after_client:
                done = run_steps(self._steps(reg, args, store, deadline, tokens, block_ids))
        finally:
            self._sessions.done_with(reg)
        return {"tokens": int(done), "signalled": False}

    def start(
        self, session: Session, args: TransferArgs, *, store: bool, deadline: float | None, request_id: int
    ) -> Started | None:
        """Run a GPU transfer naming a done flag up to its copy being enqueued (None: not such a transfer, `run` it
        on a worker). Answered now when the copy is all that is left (`signalled`: the GPU writes the flag)."""
        if args.done_slot is None or args.ready_event is not None:
            return None
        tokens, block_ids = _ids(args, store, self._engine)
        if not store:
            self._sessions.settle()
        reg = self._sessions.use_registration(session, args.registration)
        flags = reg.done_flags
        try:
            if flags is None:
                raise ProtocolError(ErrorCode.BAD_ARGUMENT, "'done_slot' needs a CUDA registration with 'done_flags'")
            flags.check_slot(args.done_slot)
            _check_ready_slot(reg, args)
            _use_device(reg.kv.device)
            self._take_lock(session, args)  # from here the steps own it (they end it however they go)
            steps = self._steps(reg, args, store, deadline, tokens, block_ids)
            with _after_client_work(reg, args):
                first = first_step(steps)
        except BaseException:
            self._sessions.done_with(reg)
            raise
        if isinstance(first, Finished):  # nothing to copy: done
            self._sessions.done_with(reg)
            return Started({"tokens": int(first.result), "signalled": False}, None)
        if first.handle is None and first.final:  # nothing in flight, nothing to wait for (chunks all present)
            try:
                done = finish_steps(steps)
            finally:
                self._sessions.done_with(reg)
            return Started({"tokens": int(done), "signalled": False}, None)
        answer = None
        if first.final and first.handle is not None:
            try:
                flags.signal(first.handle, args.done_slot, int(args.done_seq or 0))
            except Exception:  # answered after the copy instead
                log.exception("could not enqueue the done flag's write of request %d", request_id)
            else:
                answer = {"tokens": int(first.tokens), "signalled": True}

        def finish() -> dict[str, Any]:
            try:
                with _after_client_work(reg, args):
                    done = finish_steps(steps)
                return {"tokens": int(done), "signalled": False}
            finally:
                self._sessions.done_with(reg)
                if answer is not None:
                    self._sessions.answered(session, request_id)

        once = FinishOnce(finish)
        if answer is not None:
            self._sessions.answering_early(session, request_id, first.handle, once.settle)
        return Started(answer, once)

    def _take_lock(self, session: Session, args: TransferArgs) -> None:
        if args.lock is not None and not self._sessions.drop_lock(session, args.lock):
            raise ProtocolError(ErrorCode.UNKNOWN_LOCK, f"'lock'={args.lock} is not held by this session")

    def _steps(
        self,
        reg: Registration,
        args: TransferArgs,
        store: bool,
        deadline: float | None,
        tokens: Any,
        block_ids: Any,
    ) -> Steps[int]:
        where = {
            "namespace": reg.namespace,
            "block_size": reg.block_size,
            "geometry": reg.geometry,
            "skip_prefix_tokens": args.skip_prefix_tokens,
        }
        if store:
            return self._engine.store_steps(
                tokens, reg.kv.paged, block_ids, reg.format, valid_until=deadline, tail=args.tail, pages=args.pages,
                **where,
            )  # fmt: skip
        return self._engine.retrieve_steps(
            tokens, reg.kv.paged, block_ids, reg.format, lock_id=args.lock, pages=args.pages, **where
        )


def _ids(args: TransferArgs, store: bool, engine: CacheTransfers) -> tuple[Any, Any]:
    """The request's token and block ids, after the checks that need no registration: the tokens of pages sent as
    their keys made when the cache first reads them (a store's copy is enqueued first)."""
    if args.page_keys is None:
        tokens: Any = unpack_ids(args.tokens, "tokens")
    elif not args.pages or args.tokens:
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, "'page_keys' go with 'pages' and instead of 'tokens'")
    else:
        try:
            tokens = KeyedPages.received(args.page_keys, engine.chunk_size)  # pages=True: a chunk is a page
        except ValueError as exc:
            raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"'page_keys': {exc}") from None
    block_ids = unpack_ids(args.block_ids, "block_ids")
    if store and args.lock is not None:
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, "'lock' belongs to RETRIEVE, not STORE")
    if (args.done_slot is None) != (args.done_seq is None):
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, "give both 'done_slot' and 'done_seq', or neither")
    return tokens, block_ids


_thread = threading.local()


def _use_device(device: Any) -> None:
    """Make `device` this thread's current CUDA device (its context current), once. The socket thread starts with
    none, and the transfer engine would then switch the context in and out around every request."""
    if getattr(_thread, "device", None) != device:
        import torch

        torch.cuda.set_device(device)
        _thread.device = device


def _check_ready_slot(reg: Registration, args: TransferArgs) -> None:
    events = 0 if reg.ready is None else len(reg.ready.events)
    if args.ready_slot is not None and args.ready_slot >= events:
        raise ProtocolError(
            ErrorCode.BAD_ARGUMENT, f"'ready_slot'={args.ready_slot}, but the registration has {events} events"
        )


def _after_client_work(reg: Registration, args: TransferArgs) -> contextlib.AbstractContextManager[None]:
    """The GPU transfers this thread enqueues in the block wait, on the GPU, for the client's work recorded in the
    transfer's ready event (`ordered_after`): a slot of the registration's ring, or an event sent with it, opened
    here (a BAD_ARGUMENT if it cannot be). No CPU thread blocks on the engine's work, and no other client's transfer
    queues behind it. The same holds for a transfer resumed on another thread (chunks a concurrent store gave up):
    it has not been answered, so the client has not recorded that slot again."""
    if args.ready_slot is not None:
        assert reg.ready is not None  # `_check_ready_slot` refused a slot the registration does not have
        return ordered_after(reg.ready.raw_events[args.ready_slot])
    if args.ready_event is not None:
        return _ordered_after_opened(open_client_event(reg.kv.device, args.ready_event))
    return contextlib.nullcontext()


@contextlib.contextmanager
def _ordered_after_opened(event: Any) -> Iterator[None]:
    """`ordered_after` an opened `torch.cuda.Event`, held until the transfers that wait for it are enqueued."""
    with ordered_after(event.cuda_event):
        yield

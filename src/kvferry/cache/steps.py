"""A store or retrieve as steps: the work up to its copy being enqueued, then the rest (waiting for the copy,
making stored chunks readable, releasing what a retrieve held).

A GPU copy runs on its own once enqueued, so whoever starts a transfer need not be the thread that waits for it:
the server enqueues on its socket thread, answers the client at once, and leaves the wait to a worker. The steps
are a generator that yields once, an `Enqueued`, when the copy is in flight (a transfer with nothing to copy
returns without yielding); its return value is the transfer's result. Closing it early still finishes the copy's
bookkeeping (it waits for the copy), so no object or lock outlives an abandoned transfer.

A transfer started on the caller's thread leaves the rest to a worker, as a `Rest`: a future that a thread waiting
for its result before the worker took it runs itself (`kvferry.futures`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

from kvferry.futures import HelpedFuture
from kvferry.transfer import ordered_after

if TYPE_CHECKING:
    from kvferry.transfer.handle import TransferHandle

T = TypeVar("T")
log = logging.getLogger(__name__)


class RecordedEvent(Protocol):
    """A CUDA event recorded on a caller's stream (`torch.cuda.Event`, `kvferry.transfer.stream_marks.StreamMark`):
    the GPU copies of a transfer's later steps wait for it."""

    @property
    def cuda_event(self) -> int: ...


class StreamMark(RecordedEvent, Protocol):
    def release(self, _: Any = None) -> None:
        """Done with it: the work ordered after it is enqueued."""
        ...


class StreamMarker(Protocol):
    """Records marks of the calling thread's current stream (`kvferry.transfer.stream_marks.StreamMarks`)."""

    def record(self) -> StreamMark: ...


class Enqueued(NamedTuple):
    """A transfer's copy is in flight (`handle`: None when it was done on return, as on the CPU). `final`: the
    copy is all that is left of the transfer and `tokens` is its result, so it may be reported now (a store whose
    copy then ends after its `valid_until` still drops its chunks: its caller had stopped waiting). `landed`: what
    comes after the copy changes nothing its caller sees (a retrieve's readers let go, its counters), so a `Rest`
    resolves to `tokens` as soon as the copy has ended and does that after (a store's chunks become readable
    after it: a store's future waits for that)."""

    handle: TransferHandle | None
    tokens: int
    final: bool
    landed: bool = False


class Finished(NamedTuple):
    """A transfer that ended without a copy in flight, and its result."""

    result: Any


Steps = Generator[Enqueued, None, T]


def run_steps(steps: Steps[T]) -> T:
    """Run a transfer's steps to the end on this thread; its result."""
    try:
        next(steps)
    except StopIteration as stop:
        return stop.value
    return finish_steps(steps)


def first_step(steps: Steps[T]) -> Enqueued | Finished:
    """Run up to the copy being enqueued: the `Enqueued`, or `Finished` when the transfer ended without a copy."""
    try:
        return next(steps)
    except StopIteration as stop:
        return Finished(stop.value)


def finish_steps(steps: Steps[T]) -> T:
    """The rest of a transfer whose first step ran; its result."""
    try:
        next(steps)
    except StopIteration as stop:
        return stop.value
    steps.close()
    raise RuntimeError("a transfer's steps yield once")


def started(steps: Steps[int], finish: Callable[[Steps[int], Enqueued], Future[int]]) -> Future[int]:
    """A transfer's steps run up to its copy in flight on this thread, the rest by ``finish`` (on another thread:
    its future); the result as a future, a failure before the copy (or in ``finish``) included."""
    done: Future[int] = Future()
    try:
        first = first_step(steps)
        if not isinstance(first, Finished):
            return finish(steps, first)
    except BaseException as exc:
        done.set_exception(exc)
        return done
    done.set_result(int(first.result))
    return done


def submitted(
    executor: Executor,
    call: Callable[..., int],
    steps: Callable[..., Steps[int]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    after: RecordedEvent | None,
    start_here: bool,
    marks: StreamMarker | None = None,
) -> Future[int]:
    """A transfer as a future: ``call(*args, **kwargs)`` on ``executor``, or with ``start_here`` its ``steps`` run
    to the copy in flight on this thread (`started`) and the rest as a `Rest` on ``executor``; whatever runs there
    has its GPU copies ordered after the CUDA event ``after`` (when given), or after a mark of this thread's current
    stream from ``marks``. That mark is recorded once the copy is in flight, off the path to its first GPU
    operation (~40 us of host time on the H100 host): the stream has not moved meanwhile (the copy's work is on the
    transfer engine's streams), and the mark goes back once the rest has run."""
    if not start_here:
        return executor.submit(_ordered, after, call, args, kwargs)
    if after is not None or marks is None:
        return started(steps(*args, **kwargs), lambda rest, first: Rest.submit(executor, after, rest, first))

    def marked(rest: Steps[int], first: Enqueued) -> Future[int]:
        try:
            mark = marks.record()
        except BaseException:
            rest.close()  # the copy in flight is waited for and settled; nothing after it runs unordered
            raise
        future = Rest.submit(executor, mark, rest, first)
        future.add_done_callback(mark.release)
        return future

    return started(steps(*args, **kwargs), marked)


class Rest(HelpedFuture[int]):
    """The rest of a started transfer (`finish_steps`), run once: by a worker of the executor, or by the first
    thread that waits for its result before a worker took it (`kvferry.futures`). Where its first step says the
    copy's end is its result (`Enqueued.landed`), resolved then, before the rest: a load's waiter (SGLang's forward)
    wakes while the readers are let go. `copy_end`: that copy, where its end is all its caller needs (a retrieve's,
    a store's final copy), for a caller that orders its stream after it or polls it rather than wait for a worker
    to resolve the future (`copy_end`)."""

    def __init__(self, after: RecordedEvent | None, steps: Steps[int], first: Enqueued | None = None) -> None:
        super().__init__()
        self._after = after
        self._steps: Steps[int] | None = steps
        in_flight = first if first is not None and first.handle is not None else None
        self._landed = in_flight if in_flight is not None and in_flight.landed else None
        ends = in_flight is not None and (in_flight.landed or in_flight.final)
        self.copy_end: TransferHandle | None = in_flight.handle if in_flight is not None and ends else None
        self.copied_tokens = in_flight.tokens if in_flight is not None and ends else 0  # the result, at `copy_end`
        self._claim = threading.Lock()

    @classmethod
    def submit(
        cls, executor: Executor, after: RecordedEvent | None, steps: Steps[int], first: Enqueued | None = None
    ) -> Rest:
        rest = cls(after, steps, first)
        try:
            executor.submit(rest.run, True)
        except RuntimeError:  # the executor is shutting down: the copy in flight is waited for and settled here
            rest.run()
        return rest

    def run(self, hand_over: bool = False) -> None:
        """Run the rest here, unless another thread took it. ``hand_over`` (a worker's run): where the copy's end is
        all its caller needs (`copy_end`), the threads waiting for that end (a caller's wait, SGLang's poll of an
        offload) get the GIL first, once it has come, before the bookkeeping after it holds the GIL (64 pages'
        ~0.2 ms on the H100 host: a poll of the copy's end saw it that much late)."""
        if not self._claim.acquire(blocking=False):
            return
        steps, self._steps = self._steps, None
        assert steps is not None  # taken once, under the claim
        try:
            if self._landed is not None:
                self._resolve_landed(self._landed)
            if hand_over and self.copy_end is not None:
                _ended(self.copy_end)
                _yield_gil()
            value = _ordered(self._after, finish_steps, (steps,), {})
        except BaseException as exc:
            if not self.done():
                self.set_exception(exc)
            else:  # resolved at the copy's end: what failed after it is the cache's own business
                log.warning("after a transfer's copy ended: %s: %s", type(exc).__name__, exc)
        else:
            if not self.done():
                self.set_result(value)

    def _resolve_landed(self, first: Enqueued) -> None:
        """Resolve to ``first.tokens`` once its copy has ended; a copy that failed is left to the steps, whose own
        wait raises it (and settles what the copy held)."""
        assert first.handle is not None
        if _ended(first.handle):
            self.set_result(first.tokens)

    _help = run


def _yield_gil() -> None:
    time.sleep(0)  # released around the system call: a thread waiting for the GIL takes it


def _ended(copy: TransferHandle) -> bool:
    """Wait for ``copy``'s end; False where it failed (the steps' own wait raises it, and settles what it held)."""
    try:
        copy.wait()
    except Exception:
        return False
    return True


def copy_end(future: Future[Any]) -> TransferHandle | None:
    """The GPU copy whose end is all that ``future``'s caller waits for (`Rest.copy_end`): a retrieve's, whose
    bytes are then in the engine's blocks, or a store's final copy, whose blocks the engine may then reuse (its
    chunks become readable just after, on a worker). None for a future without one: done on return, on the CPU,
    through a server, or a store with more to write after its copy."""
    return future.copy_end if isinstance(future, Rest) else None


class StoredEarly:
    """Stores whose caller may take them as done at their copy's end (`copy_end`: the engine reuses the blocks then),
    before the rest of them has made their chunks readable. `settle`, before the cache is read: the rest of each
    whose copy has ended is run on the calling thread (or waited for where a worker runs it: it follows the copy by
    microseconds), so that whoever saw one done finds its chunks, as a server does for the transfers it answers early
    (`kvferry.server.sessions`). Stores still copying are left alone: nobody can have seen them done."""

    def __init__(self) -> None:
        self._rests: set[Rest] = set()
        self._lock = threading.Lock()

    def add(self, future: Future[int]) -> None:
        """Follow ``future`` if it is a store's `Rest` that its caller may see done at its copy's end."""
        if not isinstance(future, Rest) or future.copy_end is None:
            return
        with self._lock:
            self._rests.add(future)
        future.add_done_callback(self._discard)

    def settle(self, timeout_s: float = 1.0) -> None:
        if not self._rests:  # unlocked: a store added meanwhile is one its caller has not seen done yet
            return
        with self._lock:
            rests = list(self._rests)
        for rest in rests:
            end = rest.copy_end
            try:
                if end is None or not end.done():
                    continue
            except Exception:  # a copy that failed: its rest settles what it held
                log.debug("kvferry: a store's copy failed", exc_info=True)
            rest.run()  # here, unless a worker took it
            try:
                rest.exception(timeout=timeout_s)
            except TimeoutError:
                log.warning("kvferry: a store's bookkeeping after its copy took over %.1f s", timeout_s)

    def _discard(self, rest: Future[int]) -> None:
        with self._lock:
            self._rests.discard(rest)
        error = rest.exception()
        if error is not None:  # its caller may have taken it as done at its copy's end
            log.warning("kvferry: a store's chunks were copied but not kept: %s: %s", type(error).__name__, error)


def _ordered(after: RecordedEvent | None, call: Callable[..., int], args: tuple, kwargs: dict[str, Any]) -> int:
    """``call(*args, **kwargs)`` with its GPU copies ordered after the CUDA event ``after`` (kept alive until then)."""
    if after is None:
        return call(*args, **kwargs)
    with ordered_after(after.cuda_event):
        return call(*args, **kwargs)

"""Futures whose waiter may do the last of the work that resolves them, and a future of what comes once several are
done (`when_all`), and a failed one (`failed_future`).

A transfer in flight is resolved by a background thread (a worker that waits for the copy, a thread that watches
done flags). A caller that blocks on its result anyway (a store whose blocks are about to be reused) would then
wait for that thread to wake up and hand the result back (~0.1-0.2 ms each on the H100 host, after the copy has
ended); doing the rest itself costs it nothing. Waits with a timeout only wait: the work may take longer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class HelpedFuture(Future[T]):
    """A future that `result` and `exception` without a timeout, while it is pending, first try to resolve on the
    calling thread (`_help`). Not cancellable: what resolves it is already under way. A done future only answers:
    its own done callbacks may ask it for its result, on the thread that is resolving it."""

    def _help(self) -> None:
        """Resolve the future here where that is possible now; else return and leave it to its thread."""
        raise NotImplementedError

    def result(self, timeout: float | None = None) -> T:
        if timeout is None and not self.done():
            self._help()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if timeout is None and not self.done():
            self._help()
        return super().exception(timeout)

    def cancel(self) -> bool:
        return False


def when_all(futures: Sequence[Future[Any]], then: Callable[[], T]) -> Future[T]:
    """A future of ``then()`` (or of what it raises), computed once every future in ``futures`` is done, on the
    thread that saw the last one end (here, for none); no thread waits for them."""
    result: Future[T] = Future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def finish() -> None:
        try:
            result.set_result(then())
        except BaseException as exc:
            result.set_exception(exc)

    def one_done(_: Future[Any]) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            finish()

    if not futures:
        finish()
    for future in futures:
        future.add_done_callback(one_done)
    return result


def failed_future(error: BaseException) -> Future[Any]:
    """A future that has failed with ``error`` (a call that failed before its work started, as its future)."""
    failed: Future[Any] = Future()
    failed.set_exception(error)
    return failed

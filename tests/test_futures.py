"""`kvferry.futures.when_all`: a future of what comes once several futures are done, computed on the thread that
saw the last one end, whatever they ended in."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from kvferry.futures import when_all


def test_the_result_is_computed_once_the_last_future_ends_on_its_thread() -> None:
    futures: list[Future[int]] = [Future() for _ in range(3)]
    seen: list[str] = []

    def total() -> int:
        seen.append(threading.current_thread().name)
        return sum(f.result() for f in futures)

    combined = when_all(futures, total)
    futures[0].set_result(1)
    futures[2].set_exception(RuntimeError("not this one's concern"))
    assert not combined.done()
    ender = threading.Thread(target=futures[1].set_result, args=(2,), name="ender")
    ender.start()
    ender.join()
    with pytest.raises(RuntimeError, match="not this one's concern"):  # `then` read a failed future: it raised
        combined.result(timeout=1)
    assert seen == ["ender"]


def test_none_to_wait_for_computes_at_once() -> None:
    assert when_all([], lambda: 7).result(timeout=0) == 7

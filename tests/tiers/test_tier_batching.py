import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import pytest

from kvferry.tiers.batching import Batcher


@dataclass(eq=False)
class Item:
    nbytes: int
    miss: object = None
    future: Future = field(default_factory=Future)


def test_queued_items_are_batched_up_to_count_and_byte_limits() -> None:
    batches: list[list[int]] = []
    started, release = threading.Event(), threading.Event()

    def run(batch: list[Item]) -> None:
        batches.append([item.nbytes for item in batch])
        started.set()
        release.wait(5)
        for item in batch:
            item.future.set_result(item.nbytes)

    batcher = Batcher(run, workers=1, max_items=3, max_bytes=100, name="test")
    items = [Item(1)]
    batcher.submit(items[0])
    assert started.wait(5)
    items += [Item(n) for n in (10, 10, 10, 10, 90, 5, 5)]
    for item in items[1:]:
        batcher.submit(item)
    release.set()
    batcher.close()
    assert batches == [[1], [10, 10, 10], [10, 90], [5, 5]]
    assert [item.future.result() for item in items] == [1, 10, 10, 10, 10, 90, 5, 5]


def test_a_failing_or_forgetful_runner_still_completes_every_future() -> None:
    def run(batch: list[Item]) -> None:
        batch[0].future.set_result("done")
        raise RuntimeError("boom")

    batcher = Batcher(run, workers=2, max_items=4, max_bytes=1 << 20, name="test")
    items = [Item(1, miss=False) for _ in range(10)]
    for item in items:
        batcher.submit(item)
    batcher.close()
    assert all(item.future.done() for item in items)
    assert {item.future.result() for item in items} <= {"done", False}


def test_closed_batcher_refuses_new_items() -> None:
    batcher = Batcher(lambda batch: None, workers=1, max_items=1, max_bytes=1, name="test")
    batcher.close()
    assert batcher.submit(Item(1)) is False


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="must all be >= 1"):
        Batcher(lambda batch: None, workers=0, max_items=1, max_bytes=1, name="test")

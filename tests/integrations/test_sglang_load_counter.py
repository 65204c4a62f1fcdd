"""The linker's layer counter (`load_counter`): a forward's wait for a layer whose copies run on the GPU orders its
stream after them without waiting on the CPU, once per stream and group; layers copied elsewhere are waited for on
the CPU; `finish` reports a load that did not land either way. GPU copies faked (what they are asked to do is
recorded); the GPU test of the same is `test_sglang_replayed_pools`."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from kvferry.integrations.sglang.load_counter import LoadCounter

LAYERS = 6
GROUPS = [range(0, 2), range(2, 4), range(4, 6)]


@dataclass(frozen=True)
class Stream:
    cuda_stream: int


@dataclass
class End:
    """A copy's end, recording the streams ordered after it."""

    name: str
    waited_by: list[int] = field(default_factory=list)

    def done(self) -> bool:
        return False

    def wait_on(self, stream: Stream | None = None) -> None:
        assert stream is not None
        self.waited_by.append(stream.cuda_stream)


class Streams:
    def __init__(self) -> None:
        self.current = Stream(7)

    def __call__(self) -> Stream:
        return self.current


def test_a_forward_on_the_gpu_waits_for_each_group_once_per_stream_and_never_on_the_cpu() -> None:
    streams = Streams()
    counter = LoadCounter(LAYERS, streams)
    index = counter.update_producer()
    ends = [[End("a"), End("b")], [End("c")], [End("d")]]
    counter.on_device(index, GROUPS, ends)
    counter.set_consumer(index)
    counter.wait_until(0)  # no layer completed on the CPU: a CPU wait would block here for good
    assert [e.waited_by for e in ends[0]] == [[7], [7]] and not ends[1][0].waited_by
    counter.wait_until(1)
    counter.wait_until(3)
    assert ends[0][0].waited_by == [7] and ends[1][0].waited_by == [7] and not ends[2][0].waited_by
    streams.current = Stream(9)  # another stream reads a later layer: it waits for every group up to it
    counter.wait_until(5)
    assert [e.waited_by for group in ends for e in group] == [[7, 9], [7, 9], [7, 9], [9]]
    assert not any(counter.landed(index, layer) for layer in range(LAYERS))


def test_a_group_copied_elsewhere_is_waited_for_on_the_cpu_with_the_groups_after_it() -> None:
    counter = LoadCounter(LAYERS, Streams())
    index = counter.update_producer()
    first = End("a")
    counter.on_device(index, GROUPS, [[first], None, []])
    counter.set_consumer(index)
    counter.wait_until(1)
    assert first.waited_by == [7]
    landed = threading.Timer(0.1, lambda: [counter.complete(index, layer) for layer in range(LAYERS)])
    landed.start()
    began = time.monotonic()
    counter.wait_until(4)  # group 2 has no copy of its own, but comes after the CPU's group 1
    assert time.monotonic() - began >= 0.05 and counter.landed(index, 4)
    landed.join()
    assert counter.finish(index)


def test_finish_reports_a_load_that_failed_after_the_forward_ran_on_the_gpu() -> None:
    counter = LoadCounter(LAYERS, Streams())
    index = counter.update_producer()
    counter.on_device(index, GROUPS, [[End("a")], [End("b")], [End("c")]])
    counter.set_consumer(index)
    for layer in range(LAYERS):
        counter.wait_until(layer)  # never raises into the forward
    for layer in range(2):
        counter.complete(index, layer)
    counter.fail(index, RuntimeError("2 pages were not in kvferry's cache any more"))
    assert not counter.finish(index)
    assert counter.finish(index)  # taken: an unknown batch has nothing to report
    counter.wait_until(0)  # a consumer whose batch is finished waits for nothing


def test_a_batch_without_copies_on_the_gpu_waits_on_the_cpu_and_reset_drops_every_batch() -> None:
    def no_gpu() -> Stream:
        raise AssertionError("a CPU batch asked for a CUDA stream")

    counter = LoadCounter(LAYERS, no_gpu)
    index = counter.update_producer()
    counter.set_consumer(index)
    for layer in range(LAYERS):
        counter.complete(index, layer)
        counter.wait_until(layer)
    other = counter.update_producer()
    counter.on_device(other, GROUPS, [[End("a")], [End("b")], [End("c")]])
    counter.reset()
    assert counter.producer_index == -1 and counter.consumer_index == -1
    assert counter.finish(other) and counter.finish(index)  # dropped: nothing to wait for
    assert counter.update_producer() == 0


def test_a_group_completed_at_once_wakes_every_waiter_and_finish_waits_for_the_last_layer() -> None:
    counter = LoadCounter(LAYERS, Streams())
    index = counter.update_producer()
    counter.set_consumer(index)
    woke: list[int] = []
    waiters = [threading.Thread(target=lambda layer=layer: (counter.wait_until(layer), woke.append(layer)))
               for layer in (0, 3, 5)]  # fmt: skip
    for waiter in waiters:
        waiter.start()
    time.sleep(0.05)
    assert woke == [] and not counter.landed(index, 0)
    counter.complete_layers(index, range(0, 4))
    finished: list[bool] = []
    finisher = threading.Thread(target=lambda: finished.append(counter.finish(index)))
    finisher.start()
    for waiter in waiters[:2]:
        waiter.join(timeout=5)
    time.sleep(0.05)
    assert sorted(woke) == [0, 3] and finished == [] and counter.landed(index, 3) and not counter.landed(index, 4)
    counter.complete_layers(index, range(4, LAYERS))
    waiters[2].join(timeout=5)
    finisher.join(timeout=5)
    assert sorted(woke) == [0, 3, 5] and finished == [True]


def test_a_failure_after_every_layer_landed_changes_nothing() -> None:
    counter = LoadCounter(LAYERS, Streams())
    index = counter.update_producer()
    counter.complete_layers(index, range(LAYERS))
    counter.fail(index, RuntimeError("too late to matter"))
    assert counter.finish(index)


def test_a_thread_about_to_wait_on_the_cpu_first_runs_the_batch_s_own_wait() -> None:
    counter = LoadCounter(LAYERS, Streams())
    index = counter.update_producer()
    asked: list[int] = []

    def before_waiting(layer: int) -> None:  # the linker's: the moves waited for here complete their layers
        asked.append(layer)
        counter.complete_layers(index, range(0, 4))

    counter.on_host(index, before_waiting)
    counter.set_consumer(index)
    counter.wait_until(3)  # completed by the call: no other thread involved
    counter.wait_until(1)  # settled: nothing more to run
    assert asked == [3]

    other = counter.update_producer()
    counter.on_device(other, GROUPS, [[End("a")], [End("b")], [End("c")]])
    counter.on_host(other, lambda layer: asked.append(-1))
    counter.set_consumer(other)
    counter.wait_until(5)  # ordered on the GPU: the CPU waits for nothing
    assert asked == [3]


def test_a_failure_of_the_batch_s_own_wait_is_not_raised_into_the_forward() -> None:
    counter = LoadCounter(LAYERS, Streams())
    index = counter.update_producer()

    def broken(layer: int) -> None:
        counter.fail(index, RuntimeError("the server went away"))
        raise RuntimeError("the server went away")

    counter.on_host(index, broken)
    counter.set_consumer(index)
    counter.wait_until(0)
    assert not counter.finish(index)

"""Pooled marks of a caller's stream (`kvferry.transfer.stream_marks`): a transfer ordered after one waits for the
work queued before it, and a released mark's event is recorded again only for a later mark; a mark of several
streams waits for each, and inside `ordered_after` a mark, or a server transfer's ready event, comes after its
event."""

from __future__ import annotations

import pytest
import torch

from kvferry.client.ready_events import ReadyEvents
from kvferry.cuda.driver import driver
from kvferry.transfer import ordered_after
from kvferry.transfer.stream_marks import StreamMarks

pytestmark = pytest.mark.gpu
SLEEP_CYCLES = 200_000_000  # ~0.1 s of one SM: long enough that a wait that is not ordered after it is seen


def test_a_mark_waits_for_the_work_queued_before_it_on_the_callers_stream() -> None:
    marks = StreamMarks(torch.device("cuda"))
    side = torch.cuda.Stream()
    data = torch.zeros(1, device="cuda")
    try:
        torch.cuda._sleep(SLEEP_CYCLES)
        data.fill_(7)
        mark = marks.record()
        with torch.cuda.stream(side):  # another thread's stream, ordered after the mark as `ordered_after` does
            driver().wait(side.cuda_stream, mark.cuda_event, 0)
            seen = data.clone()
        assert not driver().query(mark.cuda_event)  # the sleep is still running: the mark has not fired
        side.synchronize()
        assert seen.item() == 7
        mark.release()
        mark.release()  # once only
        again = marks.record()
        assert again.cuda_event == mark.cuda_event  # the pool's one event, recorded again
        again.release()
    finally:
        torch.cuda.synchronize()
        marks.close()


def test_marks_out_when_the_pool_closes_are_destroyed_when_they_come_back() -> None:
    marks = StreamMarks(torch.device("cuda"))
    first, second = marks.record(), marks.record()
    assert first.cuda_event != second.cuda_event
    first.release()
    marks.close()
    second.release()  # destroyed now, not pooled
    assert marks._free == []


def test_a_mark_on_several_streams_waits_for_each_and_changes_none_of_them() -> None:
    marks = StreamMarks(torch.device("cuda"))
    scheduler, forward, side = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    data = torch.zeros(2, device="cuda")
    try:
        for timed in (False, True):  # the first pass loads every kernel (a lazy load may wait for the device)
            torch.cuda.synchronize()
            with torch.cuda.stream(scheduler):
                data[0].fill_(3)
            with torch.cuda.stream(forward):  # still writing when the mark is made
                torch.cuda._sleep(4 * SLEEP_CYCLES if timed else 1)
                data[1].fill_(7)
            mark = marks.record_on([scheduler.cuda_stream, forward.cuda_stream])
            with torch.cuda.stream(side):
                driver().wait(side.cuda_stream, mark.cuda_event, 0)
                seen = data.clone()
            later = torch.cuda.Event()
            later.record(scheduler)
            later.synchronize()  # the scheduler's stream goes on: it waits for nothing of the forward's
            assert not timed or (not forward.query() and not driver().query(mark.cuda_event))
            side.synchronize()
            assert seen.tolist() == [3.0, 7.0]
            mark.release()
            data.zero_()
        assert len(marks._free) == 1  # each wait took its event's state: one event served each stream and the mark
    finally:
        torch.cuda.synchronize()
        marks.close()


def test_inside_ordered_after_a_mark_is_the_blocks_event_lent() -> None:
    marks = StreamMarks(torch.device("cuda"))
    event = torch.cuda.Event()
    event.record()
    try:
        with ordered_after(event.cuda_event):
            mark = marks.record()
        assert mark.cuda_event == event.cuda_event
        mark.release()
        assert marks._free == []  # lent, not the pool's
        assert marks.record().cuda_event != event.cuda_event  # outside the block: the current stream's mark
    finally:
        torch.cuda.synchronize()
        marks.close()


def test_a_servers_ready_event_inside_ordered_after_comes_after_the_blocks_event() -> None:
    ready = ReadyEvents(torch.device("cuda"), slots=1)
    busy = torch.cuda.Stream()
    with torch.cuda.stream(busy):
        torch.cuda._sleep(SLEEP_CYCLES)
    after = torch.cuda.Event()
    after.record(busy)
    try:
        with ordered_after(after.cuda_event):
            slot = ready.record()
            fresh = ready.record_fresh()  # every slot in use
        assert slot == 0 and ready.record() is None
        assert not driver().query(ready.events[0].cuda_event) and not fresh.query()
        torch.cuda.current_stream().synchronize()  # the current stream was not made to wait
        assert not busy.query()
        torch.cuda.synchronize()
        assert driver().query(ready.events[0].cuda_event) and fresh.query()
    finally:
        torch.cuda.synchronize()

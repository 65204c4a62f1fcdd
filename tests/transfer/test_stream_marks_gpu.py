"""Pooled marks of a caller's stream (`kvferry.transfer.stream_marks`): a transfer ordered after one waits for the
work queued before it, and a released mark's event is recorded again only for a later mark."""

from __future__ import annotations

import pytest
import torch

from kvferry.cuda.driver import driver
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

"""The Unix socket's framing (`kvferry.protocol.unix_framing`): frames cut anywhere across reads come out whole."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.protocol.unix_framing import HEADER, FrameTooLarge, frame, take_frames


@settings(max_examples=200, deadline=None)
@given(payloads=st.lists(st.binary(max_size=300), max_size=8), cuts=st.lists(st.integers(0, 2500), max_size=12))
def test_frames_split_across_reads_come_out_whole_and_in_order(payloads: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(frame(p) for p in payloads)
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    inbox = bytearray()
    got = []
    for lo, hi in itertools.pairwise(bounds):
        got += [bytes(view) for view in take_frames(inbox, stream[lo:hi], max_bytes=300)]
    assert got == payloads
    assert not inbox  # nothing unfinished left over


def test_a_frame_announcing_more_than_the_limit_is_refused_before_it_is_read() -> None:
    header = HEADER.pack(301)
    with pytest.raises(FrameTooLarge, match="301-byte frame"):
        take_frames(bytearray(), header + b"x" * 10, max_bytes=300)
    inbox = bytearray()
    assert take_frames(inbox, header[:2], max_bytes=300) == []  # the header cut in two reads
    with pytest.raises(FrameTooLarge, match="301-byte frame"):
        take_frames(inbox, header[2:] + b"x" * 10, max_bytes=300)


def test_a_frame_in_many_reads_is_kept_as_it_came_until_whole() -> None:
    payload = bytes(range(256)) * 64
    stream = frame(payload)
    inbox = bytearray()
    for at in range(0, len(stream) - 1000, 1000):
        assert take_frames(inbox, stream[at : at + 1000]) == []
        assert bytes(inbox) == stream[: at + 1000]  # appended, nothing else
    got = take_frames(inbox, stream[len(inbox) :] + frame(b"next"))
    assert [bytes(view) for view in got] == [payload, b"next"] and not inbox

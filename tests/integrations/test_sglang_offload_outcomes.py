"""The SGLang linker's offload outcomes (`offload_outcomes`): taken in the order the offloads started, whatever order
their copies end in, as SGLang pairs the n-th outcome it takes with its n-th offload."""

from __future__ import annotations

import threading
from concurrent.futures import Future

from kvferry.futures import when_all
from kvferry.integrations.sglang.offload_outcomes import Move, OffloadOutcomes, stored


def _moves(n: int) -> list[Move]:
    return [(4, Future()) for _ in range(n)]


def _offload(outcomes: OffloadOutcomes, moves: list[Move]) -> None:
    """As `LinkerStore.offload` follows an offload's moves."""
    outcomes.add(when_all([future for _, future in moves], lambda: stored(moves)))


def test_an_offload_that_ends_first_waits_for_the_one_started_before_it() -> None:
    outcomes = OffloadOutcomes()
    first, second = _moves(2), _moves(1)
    _offload(outcomes, first)
    _offload(outcomes, second)
    second[0][1].set_exception(RuntimeError("the pool is full"))
    assert outcomes.ended() == 0 and outcomes.take() is False  # the first has not ended: nothing to take
    first[0][1].set_result(64)
    assert outcomes.ended() == 0  # one of its two moves is still running
    first[1][1].set_result(64)
    assert outcomes.ended() == 2
    assert outcomes.take() is True and outcomes.take() is False  # stored, then failed
    assert outcomes.ended() == 0 and outcomes.take() is False  # none left


def test_an_offload_with_nothing_to_move_ends_at_once_in_its_turn() -> None:
    outcomes = OffloadOutcomes()
    running = _moves(1)
    _offload(outcomes, running)
    _offload(outcomes, [])
    assert outcomes.ended() == 0
    running[0][1].set_result(0)  # stored nothing new (the cache held the pages): stored all the same
    assert outcomes.ended() == 2 and outcomes.take() is True and outcomes.take() is True


def test_clear_waits_for_the_offloads_under_way_and_drops_their_outcomes() -> None:
    outcomes = OffloadOutcomes()
    running = _moves(3)
    _offload(outcomes, running)
    ends = threading.Timer(0.05, lambda: [future.set_result(64) for _, future in running])
    ends.start()
    outcomes.clear()
    assert all(future.done() for _, future in running)
    assert outcomes.ended() == 0 and outcomes.take() is False
    ends.join()


def test_moves_ending_on_several_threads_end_their_offload_once() -> None:
    moves = _moves(64)
    calls: list[bool] = []
    when_all([future for _, future in moves], lambda: calls.append(True))
    threads = [threading.Thread(target=future.set_result, args=(64,)) for _, future in moves]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls == [True]


class CopyEnd:
    """An offload's copy (on the GPU, or through a server), faked: ended when told, or failing when queried."""

    def __init__(self, error: Exception | None = None) -> None:
        self.ended, self.error = False, error

    def done(self) -> bool:
        if self.error is not None:
            raise self.error
        return self.ended


def test_an_offload_ends_with_its_copies_before_its_future_resolves() -> None:
    outcomes = OffloadOutcomes()
    first, second = _moves(1), _moves(2)
    ends = [CopyEnd(), CopyEnd()]
    outcomes.add(when_all([f for _, f in first], lambda: stored(first)), [ends[0].done])
    outcomes.add(when_all([f for _, f in second], lambda: stored(second)), [ends[1].done])
    ends[1].ended = True
    assert outcomes.ended() == 0  # the first has not: its outcome comes first
    ends[0].ended = True
    assert outcomes.ended() == 2  # neither future resolved: the workers have not made the pages readable yet
    assert outcomes.take() is True
    second[0][1].set_exception(RuntimeError("the pool is full"))  # after its copy: the pages are a miss
    second[1][1].set_result(64)
    assert outcomes.take() is False  # its outcome had come meanwhile: it is what is taken
    first[0][1].set_result(64)
    assert outcomes.ended() == 0


def test_an_offload_whose_copy_end_cannot_be_queried_ends_with_its_future() -> None:
    outcomes = OffloadOutcomes()
    moves = _moves(1)
    failing = CopyEnd(RuntimeError("an illegal address"))
    outcomes.add(when_all([f for _, f in moves], lambda: stored(moves)), [failing.done])
    assert outcomes.ended() == 0 and outcomes.take() is False
    moves[0][1].set_exception(RuntimeError("an illegal address"))
    assert outcomes.ended() == 1 and outcomes.take() is False

"""A transfer's copy seen to end before its future resolves: for a caller that only needs the bytes moved (an
engine that reuses the blocks a store read, a forward that reads the blocks a load wrote), not what the transfer
does after its copy (a store's chunks made readable, a load's readers let go) or the thread that resolves it.

In process on a GPU the copy's end is a CUDA event (`kvferry.cache.steps.copy_end`): a stream can wait for it and a
query sees it. Through a server it is the transfer's done flag (`kvferry.client.done_flags`): a load of a word.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kvferry.cache.steps import Rest, copy_end
from kvferry.client.done_flags import FlagFuture

__all__ = ["copied", "copied_probe", "copy_end", "wait_here"]


def copied_probe(future: Future[Any]) -> Callable[[], bool] | None:
    """A call that tells whether the copy of the transfer ``future`` stands for has ended (raising for one that
    failed on the GPU), where there is one: in process on a GPU, or through a server that answered before the copy
    ended; None otherwise (the future resolves with the copy, or the transfer has more to do after it)."""
    end = copy_end(future)
    if end is not None:
        return end.done
    if isinstance(future, FlagFuture):
        return future.copied
    return None


def copied(future: Future[int]) -> int:
    """The tokens of the transfer ``future`` stands for, waited for to its copy's end where that is all its caller
    needs (`copy_end`: in process, on a GPU; what comes after runs on a worker, and the cache settles it before it
    is read), else to its end."""
    end = copy_end(future)
    if end is None or future.done():
        return future.result()
    end.wait()
    assert isinstance(future, Rest)  # the only futures with a `copy_end`
    return future.copied_tokens


def wait_here(future: Future[Any]) -> None:
    """Wait on this thread for a transfer through a server that answered before its copy ended (its done flag
    looked at here, and the future resolved here, by `FlagFuture`'s help), rather than for the client's watch thread
    to see the flag (a 50 us poll) and hand the end over; anything else is left to whoever resolves it (nothing
    waited for). Raises nothing: the future says how it went."""
    if isinstance(future, FlagFuture) and not future.done():
        future.exception()

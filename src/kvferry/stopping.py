"""Stopping within a deadline: joins and ZMQ context terminations that give up instead of hanging.

A stop that waits without a deadline turns one stuck thread (a tier that stopped answering, a copy that never
ends) into a process that ignores its operator's Ctrl-C. Each helper here waits at most until a deadline, says
whether what it waited for ended, and leaves whatever did not to the process's exit.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import zmq

log = logging.getLogger("kvferry")


def time_left(deadline: float) -> float:
    """Seconds from now until `deadline` (a `time.monotonic()` value), never negative."""
    return max(0.0, deadline - time.monotonic())


def join_thread(thread: threading.Thread, deadline: float) -> bool:
    """Wait for `thread` until `deadline`; True if it ended (or never started)."""
    if thread.ident is not None:
        thread.join(time_left(deadline))
    return not thread.is_alive()


def shut_down_pool(pool: ThreadPoolExecutor, deadline: float) -> bool:
    """Let `pool` run what it was given (running and queued tasks) until `deadline`; True if its threads ended.

    `ThreadPoolExecutor.shutdown(wait=True)` has no timeout, so the pool's threads are joined here instead: its
    `_threads` is the only handle on them.
    """
    pool.shutdown(wait=False)
    threads = list(pool._threads)
    return all([join_thread(thread, deadline) for thread in threads])


def term_context(context: zmq.Context, deadline: float) -> bool:
    """`context.term()`, given up on at `deadline`; True if it returned.

    `term` blocks until every socket of the context is closed: a socket still held by a thread that did not stop
    would hold the caller forever. Given up on, it finishes on a daemon thread whenever that socket closes, or
    never, which the process's exit does not wait for.
    """
    terminating = threading.Thread(target=context.term, name="kvferry-zmq-term", daemon=True)
    terminating.start()
    if join_thread(terminating, deadline):
        return True
    log.warning("a ZMQ context still had open sockets at the stop's deadline; left to the process's exit")
    return False


def still_running() -> list[str]:
    """The names of the threads other than this one still alive (for a stop that missed its deadline)."""
    current = threading.current_thread()
    return sorted(t.name for t in threading.enumerate() if t is not current and t.is_alive())

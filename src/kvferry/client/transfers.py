"""`Transfers`: a client's STOREs and RETRIEVEs, answered after the copy, or once it is enqueued with its end shown
by a done flag (`kvferry.client.done_flags`)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

from kvferry.client.connection import Connection
from kvferry.client.done_flags import LOST_DRAIN_S, DoneFlags, FlagFuture, FlagWatch, release_slot, take_slot
from kvferry.client.errors import ServerError, ServerUnavailable
from kvferry.client.records import GpuRegistration
from kvferry.protocol.messages import Op


class Transfers:
    """Sends a `KvferryClient`'s transfers over its connection and sees each to its end: its reply, then for GPU KV
    answered early its done flag (waited for on the caller's thread, or watched by one thread for the futures)."""

    def __init__(self, conn: Connection, gpu: dict[int, GpuRegistration]) -> None:
        """`gpu`: the client's registrations of GPU KV, the very dict it keeps up to date (only read here)."""
        self._conn = conn
        self._gpu = gpu
        self._flag_watch = FlagWatch(self.check_up)

    def close(self, deadline: float) -> None:
        """Stop watching flags: transfers still waiting for theirs fail (ConnectionError)."""
        self._flag_watch.close(deadline)

    def run(self, op: Op, registration: int, args: dict[str, Any]) -> int:
        """Send a STORE or RETRIEVE and wait for it on this thread, its done flag included; the tokens copied."""
        flags = self.flags(registration)
        slot = take_slot(flags, args)
        deadline = time.monotonic() + self._conn.timeout_s
        sent: list[Future[Any]] = []

        def send() -> Future[Any]:
            sent.append(self.submit(op, registration, args))
            return sent[-1]

        try:
            result = self._conn.call(send)
        except ServerError:  # refused before anything was enqueued: nothing will write the flag
            release_slot(flags, slot)
            raise
        except ServerUnavailable:
            if sent and registration in self._gpu:
                time.sleep(LOST_DRAIN_S)  # see _lost_mid_copy
            raise
        if slot is not None and result["signalled"]:
            assert flags is not None  # the slot was taken from them
            flags.wait(slot, args["done_seq"], deadline, self.check_up)
        release_slot(flags, slot)  # seen, or never to be written (answered after the copy)
        return int(result["tokens"])

    def run_async(self, op: Op, registration: int, args: dict[str, Any]) -> Future[int]:
        """`run` with a future: it resolves to the tokens copied once the copy has ended (its done flag shown)."""
        flags = self.flags(registration)
        slot = take_slot(flags, args)
        deadline = time.monotonic() + self._conn.timeout_s
        outcome = FlagFuture()
        reply = self.submit(op, registration, args)

        def replied(done: Future[dict[str, Any]]) -> None:
            watched = None
            try:
                error = done.exception()
                if error is not None:
                    if isinstance(error, ServerError):
                        release_slot(flags, slot)
                    if isinstance(error, ServerUnavailable) and registration in self._gpu:
                        _fail_later(outcome, error)  # see _lost_mid_copy
                    else:
                        outcome.set_exception(error)
                    return
                result = done.result()
                if slot is not None and result["signalled"]:
                    assert flags is not None  # the slot was taken from them
                    tokens = int(result["tokens"])
                    watched = self._flag_watch.watch(flags, slot, args["done_seq"], outcome, tokens, deadline)
                    return
                release_slot(flags, slot)
                outcome.set_result(int(result["tokens"]))
            finally:
                outcome.answered(watched)

        reply.add_done_callback(replied)
        return outcome

    def submit(self, op: Op, registration: int, args: dict[str, Any]) -> Future[dict[str, Any]]:
        """Send a STORE or RETRIEVE; its future resolves to the server's result map. For GPU KV either one is sent
        with a ready event recorded on this thread's current stream (or after its `ordered_after` event), which the
        server's copy waits for on the GPU: a STORE reads the blocks after the work that writes them, a RETRIEVE
        writes them after the work queued before it (kernels still reading or writing blocks a finished request just
        gave back)."""
        event = None
        gpu = self._gpu.get(registration)
        ready = gpu.ready if gpu is not None else None
        slot = ready.record() if ready is not None else None
        if slot is not None:
            args["ready_slot"] = slot
        elif gpu is not None:  # every ready event of the ring in use: a fresh one
            event = gpu.ready.record_fresh()
            args["ready_event"] = bytes(event.ipc_handle())
        try:
            future = self._conn.submit(op, args, keepalive=event)
        except BaseException:  # not sent: neither the event nor the done flag will be used
            if ready is not None and slot is not None:  # a slot is one of `ready`'s events
                ready.release(slot)
            release_slot(self.flags(registration), args.get("done_slot"))
            raise
        if ready is not None and slot is not None:
            future.add_done_callback(lambda _: ready.release(slot))
        return future

    def flags(self, registration: int) -> DoneFlags | None:
        """The done flags of `registration` (None: not GPU KV, or not registered)."""
        gpu = self._gpu.get(registration)
        return gpu.flags if gpu is not None else None

    def check_up(self) -> None:
        """Raise when a transfer's done flag will not be written for us: the server is unreachable."""
        if not self._conn.available:
            raise self._conn.unavailable("the transfer")


# _lost_mid_copy: a GPU transfer sent to a server that is then lost fails only LOST_DRAIN_S later. The server's
# copy may have been enqueued, and a server torn down with GPU work queued may still carry it out (seen on the H200,
# kvferry.client.done_flags): an engine told "failed" at once could reuse blocks that copy still writes.


def _fail_later(outcome: Future[int], error: BaseException) -> None:
    timer = threading.Timer(LOST_DRAIN_S, outcome.set_exception, (error,))
    timer.daemon = True
    timer.start()

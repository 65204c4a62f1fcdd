"""A reference consumer of KV event streams: which node holds which chunk key, per medium, and the longest prefix
of a prompt each node holds (docs/events.md).

``EventSubscriber`` follows one or more streams (a kvferry server's, or anything speaking vLLM's
``ZmqEventPublisher`` protocol: `kvferry.server.event_stream`) and keeps an ``EventIndex`` up to date. Gaps in the
sequence numbers are filled from the stream's replay socket. A batch numbered at or below the last one applied but
stamped later, or a gap the buffer no longer covers, may be a new run of the stream (the publisher restarted): if
the buffer holds batch 0 and it starts with ``AllBlocksCleared``, the node is rebuilt from it. Otherwise the node
is *stale* (its entries dropped, so it is never over-predicted) until the stream's next ``AllBlocksCleared``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvferry.cache.events import LOCAL, AllCleared, ChunksStored, DecodedBatch, Record, decode_batch
from kvferry.security import ClientCurve, curve_client

log = logging.getLogger("kvferry.events")

END_SEQ = -1


def where(medium: str, locality: str) -> str:
    """The index's name for a medium: ``CPU``, ``STORAGE``; ``STORAGE:REMOTE`` for a tier other nodes share."""
    return medium if locality == LOCAL else f"{medium}:{locality}"


class EventIndex:
    """Chunk keys held, by node and medium (``where``). Not thread-safe."""

    def __init__(self) -> None:
        self._held: dict[str, dict[str, set[bytes]]] = {}
        self.stale: set[str] = set()  # nodes whose history has a hole no replay could fill

    def apply(self, node: str, records: Sequence[Record]) -> None:
        media = self._held.setdefault(node, {})
        for record in records:
            if isinstance(record, AllCleared):
                media.clear()
                self.stale.discard(node)
            elif isinstance(record, ChunksStored):
                media.setdefault(where(record.medium, record.locality), set()).update(record.keys)
            else:
                media.get(where(record.medium, record.locality), set()).difference_update(record.keys)

    def forget(self, node: str) -> None:
        """Drop what ``node`` held and mark it stale (its stream lost events that cannot be replayed)."""
        self._held.pop(node, None)
        self.stale.add(node)

    def keys(self, node: str, medium: str) -> set[bytes]:
        return set(self._held.get(node, {}).get(medium, ()))

    def summary(self) -> dict[str, dict[str, int]]:
        """Keys held by node and medium."""
        return {node: {m: len(keys) for m, keys in media.items()} for node, media in self._held.items()}

    def longest_prefix(self, keys: Sequence[bytes]) -> dict[str, dict[str, int]]:
        """For each node and medium, how many leading ``keys`` (a prompt's chunk keys, in order) it holds."""
        out: dict[str, dict[str, int]] = {}
        for node, media in self._held.items():
            for medium, held in media.items():
                n = 0
                while n < len(keys) and keys[n] in held:
                    n += 1
                out.setdefault(node, {})[medium] = n
        return out


@dataclass
class Stream:
    """One publisher: its node name, its PUB endpoint and (optional) its replay ROUTER endpoint."""

    node: str
    endpoint: str
    replay_endpoint: str | None = None
    last_seq: int = -1
    last_ts: float = float("-inf")
    gaps: int = 0  # gaps seen in the sequence numbers
    sub: Any = field(default=None, repr=False)
    monitor: Any = field(default=None, repr=False)  # the SUB socket's connections (`EventSubscriber.poll`)
    connections: int = 0  # made by the SUB socket so far


class EventSubscriber:
    """Follows ``streams`` into ``index``; call ``poll`` to receive and apply what has arrived."""

    def __init__(
        self,
        streams: Sequence[Stream],
        index: EventIndex,
        *,
        topic: bytes = b"",
        replay_timeout_s: float = 5.0,
        curve: ClientCurve | None = None,
    ) -> None:
        """``curve``: this subscriber's CURVE keys and the server's, for a server whose listeners ask for them."""
        self.index = index
        self._curve = curve
        self.streams = list(streams)
        self._replay_timeout_ms = int(replay_timeout_s * 1000)
        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
        self._by_socket: dict[Any, Stream] = {}
        self._by_monitor: dict[Any, Stream] = {}
        for stream in self.streams:
            stream.sub = self._ctx.socket(zmq.SUB)
            stream.sub.setsockopt(zmq.LINGER, 0)
            stream.sub.setsockopt(zmq.SUBSCRIBE, topic)
            if curve is not None:
                curve_client(stream.sub, curve)
            if stream.replay_endpoint is not None:  # each (re)connection is caught up from the replay socket
                stream.monitor = stream.sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
                self._poller.register(stream.monitor, zmq.POLLIN)
                self._by_monitor[stream.monitor] = stream
            stream.sub.connect(stream.endpoint)
            self._poller.register(stream.sub, zmq.POLLIN)
            self._by_socket[stream.sub] = stream
            if stream.replay_endpoint is not None:  # what was published before this subscriber connected
                got = self._fetch(stream, 0)
                if got and got[0][0] == 0:
                    self._apply_all(stream, got)

    def poll(self, timeout_s: float) -> int:
        """Receive for up to ``timeout_s`` (returning once something came); returns the batches applied."""
        applied = 0
        ready = dict(self._poller.poll(int(timeout_s * 1000)))
        for sock in ready:
            if sock in self._by_monitor:
                applied += self._reconnected(self._by_monitor[sock])
                continue
            stream = self._by_socket[sock]
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                applied += self._receive(stream, frames)
        return applied

    def close(self) -> None:
        for stream in self.streams:
            if stream.monitor is not None:
                stream.sub.disable_monitor()
        self._ctx.destroy(linger=0)

    def _reconnected(self, stream: Stream) -> int:
        """The stream's SUB socket (re)connected: what the publisher sent while it was away is not coming, and may
        be all it sends for a while (a restarted server's new run, published before this subscriber was back). Its
        replay socket has it: a new run (a batch 0 that starts afresh, stamped after the last batch applied) is
        followed from there, else the batches after the last applied are. Returns the batches applied."""
        made = 0
        while True:  # the connections made since the last look: one catch-up for all of them
            try:
                recv_monitor_message(stream.monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            made += 1
        stream.connections += made
        if stream.connections <= 1:  # the first: what came before it was fetched when this subscriber started
            return 0
        got = self._fetch(stream, 0)
        if got and got[0][0] == 0 and _afresh(got[0][1]) and got[0][1].ts > stream.last_ts:
            if stream.last_seq >= 0:
                log.info("KV events from %s: following its new run from sequence number 0", stream.node)
            stream.last_seq, stream.last_ts = -1, float("-inf")
        return self._apply_all(stream, got)

    def _receive(self, stream: Stream, frames: list[bytes]) -> int:
        parsed = _parse(stream, frames)
        if parsed is None:
            return 0
        seq, batch = parsed
        if seq <= stream.last_seq and batch.ts <= stream.last_ts:
            return 0  # a batch a replay applied already
        if seq == stream.last_seq + 1 or _afresh(batch):
            return self._apply(stream, seq, batch)
        stream.gaps += 1  # a gap, or a new run of the stream (numbered from 0 again, stamped later)
        if stream.replay_endpoint is not None:
            if seq > stream.last_seq:
                got = self._fetch(stream, stream.last_seq + 1)
                if got and got[0][0] == stream.last_seq + 1:
                    return self._apply_all(stream, [*got, (seq, batch)])
            got = self._fetch(stream, 0)
            if got and got[0][0] == 0 and _afresh(got[0][1]):
                log.info("KV events from %s: following its run from sequence number 0", stream.node)
                stream.last_seq, stream.last_ts = -1, float("-inf")
                return self._apply_all(stream, [*got, (seq, batch)])
        log.warning("KV events from %s: batches before %d lost; its entries are dropped", stream.node, seq)
        self.index.forget(stream.node)
        stream.last_seq, stream.last_ts = seq, batch.ts
        return 0

    def _apply(self, stream: Stream, seq: int, batch: DecodedBatch) -> int:
        self.index.apply(stream.node, batch.records)
        stream.last_seq, stream.last_ts = seq, batch.ts
        return 1

    def _apply_all(self, stream: Stream, got: list[tuple[int, DecodedBatch]]) -> int:
        """Apply the batches of ``got`` (replayed, then perhaps a live one) in order from the one after the last
        applied."""
        applied = 0
        for seq, batch in got:
            if seq == stream.last_seq + 1:
                applied += self._apply(stream, seq, batch)
        return applied

    def _fetch(self, stream: Stream, start: int) -> list[tuple[int, DecodedBatch]]:
        """The batches the stream's replay socket holds from ``start`` on (none if it does not answer in time)."""
        assert stream.replay_endpoint is not None
        sock = self._ctx.socket(zmq.DEALER)  # one per request: a late answer to a timed-out one goes with it
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, self._replay_timeout_ms)
        got: list[tuple[int, DecodedBatch]] = []
        try:
            if self._curve is not None:
                curve_client(sock, self._curve)
            sock.connect(stream.replay_endpoint)
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                frames = sock.recv_multipart()[1:]  # after the empty delimiter
                if len(frames) == 3 and int.from_bytes(frames[1], "big", signed=True) == END_SEQ:
                    return got
                parsed = _parse(stream, frames)
                if parsed is not None:
                    got.append(parsed)
        except zmq.Again:
            log.warning("KV events from %s: no answer from %s to a replay request", stream.node, stream.replay_endpoint)
            return []
        finally:
            sock.close(linger=0)


def _afresh(batch: DecodedBatch) -> bool:
    """Whether ``batch`` starts with ``AllBlocksCleared``: nothing before it matters."""
    return bool(batch.records) and isinstance(batch.records[0], AllCleared)


def _parse(stream: Stream, frames: list[bytes]) -> tuple[int, DecodedBatch] | None:
    if len(frames) != 3 or len(frames[1]) != 8:
        log.warning("KV events from %s: a message of %d frames ignored", stream.node, len(frames))
        return None
    try:
        return int.from_bytes(frames[1], "big"), decode_batch(frames[2])
    except ValueError as exc:
        log.warning("KV events from %s: a batch that does not decode ignored: %s", stream.node, exc)
        return None

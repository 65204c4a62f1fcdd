"""The server's KV events on ZMQ, as vLLM's ``ZmqEventPublisher`` sends them, so a router or a fleet index can follow
a kvferry server directly (the records and their encoding: `kvferry.cache.events`; where they come from:
`kvferry.cache.event_hooks`).

Wire format (vLLM's): on the PUB socket each batch is one multipart message ``[topic, seq, payload]``: ``seq`` an
8-byte big-endian sequence number from 0 at the server's start, ``payload`` a msgpack ``KVEventBatch``. The ROUTER
replay socket takes a request ``[b"", start seq as 8 bytes big-endian]`` (a REQ or DEALER socket sends it so) and
answers every buffered batch from ``start`` on as ``[b"", topic, seq, payload]``, then ``[b"", b"", -1 as 8 signed
bytes, b""]``. The first batch after a start is ``AllBlocksCleared`` and a store for everything held (what a disk
tier kept across the restart); so is the batch after the queue dropped records (counted in
``kvferry_cache_events_dropped``). An idle stream sends an empty batch every ``heartbeat_s``: a consumer that
missed the last batches (or a restart) learns so from its sequence number.

One thread owns both sockets: every ``interval_s``, or as a replay request comes, it takes what the cache queued
and sends it in batches of at most ``max_batch_events`` records, then answers the replay requests. Nothing here
runs on a transfer's thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from kvferry.cache.event_hooks import EventSource
from kvferry.cache.event_queue import EventQueue
from kvferry.cache.events import Record, encode_batch
from kvferry.config import ServerConfig
from kvferry.server.cache_service import CacheService
from kvferry.stopping import join_thread

log = logging.getLogger("kvferry.server")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventStream:
    """Publishes ``engine``'s KV events on ``config.events_port`` (and replays on ``config.events_replay_port``)."""

    def __init__(
        self,
        engine: CacheService,
        config: ServerConfig,
        ctx: zmq.Context[Any],
        *,
        interval_s: float = 0.02,
        max_batch_events: int = 1000,
        heartbeat_s: float = 1.0,
        queue_records: int = 100_000,
        replay_batches: int = 10_000,
        topic: str = "",
        secure: Callable[[zmq.Socket[Any]], None] | None = None,
    ) -> None:
        """``queue_records``: records waiting to be published, beyond which they are dropped (counted);
        ``replay_batches``: published batches kept for replay (vLLM's ``buffer_steps``); ``topic``: the first
        frame of every message (vLLM's default: empty); ``secure``: makes a socket a CURVE server before it binds
        (the request socket's authenticator: subscribers need a client key the server lets in)."""
        if config.events_port is None:
            raise ValueError("EventStream needs config.events_port")
        self._engine = engine
        self._interval_s = interval_s
        self._heartbeat_s = heartbeat_s
        self._last_sent = 0.0
        self._max_batch = max_batch_events
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=replay_batches)
        self._next_seq = 0
        self._stopping = threading.Event()
        self.batches = 0  # published since the start
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._replay: zmq.Socket[Any] | None = None
        try:
            if secure is not None:
                secure(self._pub)
            self.port = _bind(self._pub, config.host, config.events_port)
            self.replay_port: int | None = None
            if config.events_replay_port is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                if secure is not None:
                    secure(self._replay)
                self.replay_port = _bind(self._replay, config.host, config.events_replay_port)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._queue = EventQueue(queue_records)
        try:
            self._source: EventSource = engine.publish_events(self._queue)
        except BaseException:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="kvferry-events", daemon=True)
        self._thread.start()

    def stop(self, deadline: float) -> bool:
        """Publish what is queued, then close the sockets; False if the thread was still busy at ``deadline``."""
        self._stopping.set()
        ended = join_thread(self._thread, deadline)
        if ended:
            self._close_sockets()
        return ended

    def stats(self) -> dict[str, Any]:
        return {
            "port": self.port,
            "replay_port": self.replay_port,
            "batches": self.batches,
            "next_seq": self._next_seq,
            "dropped": self._queue.dropped,
        }

    # --- the publishing thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                asked = False
                if self._replay is not None:
                    asked = bool(self._replay.poll(int(self._interval_s * 1000)))
                else:
                    self._stopping.wait(self._interval_s)
                self._publish_queued()  # first: a replay then covers everything reported so far
                if asked:
                    self._serve_replays()
            self._publish_queued()
        except Exception:  # a closed context at exit; anything else is a bug, said once
            if not self._stopping.is_set():
                log.exception("the KV event stream stopped")

    def _publish_queued(self) -> None:
        records, lost = self._queue.take()
        if lost:
            log.warning("KV events: the queue was full, %d records dropped; re-announcing what is held", lost)
            self._source.resync()
            more, _ = self._queue.take()
            records += more
        for start in range(0, len(records), self._max_batch):
            self._send(records[start : start + self._max_batch])
        if time.monotonic() - self._last_sent >= self._heartbeat_s:
            self._send([])  # an idle stream's heartbeat: its number shows a consumer what it missed

    def _send(self, records: list[Record]) -> None:
        payload = encode_batch(records, self._engine.chunk_size)
        seq = self._next_seq
        self._next_seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.batches += 1
        self._last_sent = time.monotonic()

    def _serve_replays(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("KV events: a malformed replay request of %d frames ignored", len(frames))
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


def _bind(sock: zmq.Socket[Any], host: str, port: int) -> int:
    """Bind ``host:port`` (0: any free port); returns the port bound."""
    if port == 0:
        return sock.bind_to_random_port(f"tcp://{host}")
    sock.bind(f"tcp://{host}:{port}")
    return port

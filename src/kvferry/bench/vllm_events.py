"""KV events in the vLLM benchmarks (`--events`): vLLM's ZMQ publisher on loopback, and what it published of
kvferry's, read back from its replay socket as a router that joined late would."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvferry.bench.ports import ports_bound_later

REPLAY_TIMEOUT_MS = 10_000


def vllm_events_config() -> Any:
    """``--kv-events-config``: vLLM publishes its KV events on a free loopback port, with a replay socket (both
    bound once its engine has started: `ports_bound_later`)."""
    from vllm.config.kv_events import KVEventsConfig

    pub, replay = (f"tcp://127.0.0.1:{port}" for port in ports_bound_later(2))
    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=pub, replay_endpoint=replay)


def kvferry_events(replay: str) -> Iterator[Any]:
    """The events vLLM's publisher sent so far that kvferry reported (``ownership``), replayed from its first batch
    and decoded with vLLM's own ``KVEventBatch``: what a router that joined late receives."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.RCVTIMEO, REPLAY_TIMEOUT_MS)
        sock.connect(replay)
        sock.send_multipart((b"", (0).to_bytes(8, "big")))
        while True:
            _, _, seq, payload = sock.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return
            yield from (e for e in decoder.decode(payload).events if getattr(e, "ownership", None) == "kvferry")


def kvferry_blocks_stored(replay: str) -> int:
    """Blocks in the ``BlockStored`` events vLLM published for kvferry so far (`kvferry_events`)."""
    from vllm.distributed.kv_events import BlockStored

    return sum(len(e.block_hashes) for e in kvferry_events(replay) if isinstance(e, BlockStored))

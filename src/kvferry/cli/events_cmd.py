"""`kvferry events`: follow KV event streams (kvferry servers', vLLM engines') and say which node holds what.

The reference consumer of docs/events.md: an index of the chunk keys each stream's node holds, per medium
(`kvferry.client.event_index`), printed as a summary; with ``--tokens`` also the longest prefix of those tokens each
node holds, the tokens keyed as the cache keys them (``--namespace``, ``--chunk-size``, ``--hash-algo`` must be
the server's and its engines').
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

EXAMPLES = """\
examples:
  kvferry events tcp://10.0.0.1:5557,tcp://10.0.0.1:5558 --seconds 10
  kvferry events a=tcp://10.0.0.1:5557,tcp://10.0.0.1:5558 b=tcp://10.0.0.2:5557 --seconds 5 \\
      --tokens prompt.json --namespace '{"model": "Qwen/Qwen3-8B", "kv_dtype": "bfloat16", "layout": "..."}'
"""


def add_events_parser(subparsers: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]) -> None:
    parser = subparsers.add_parser(
        "events",
        help="follow KV event streams and index which node holds which prefix",
        description="Subscribe to KV event streams in vLLM's format (kvferry server --events-port, vLLM's "
        "--kv-events-config), fill gaps from their replay sockets, and print which node holds how many chunks "
        "per medium; with --tokens, the longest prefix of those tokens each node holds.",
        epilog=EXAMPLES,
        formatter_class=formatter,
    )
    parser.add_argument(
        "streams",
        nargs="+",
        metavar="[NODE=]PUB[,REPLAY]",
        help="a stream's PUB endpoint and optionally its replay endpoint; NODE names it (default: the endpoint)",
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="how long to follow before answering (5)")
    parser.add_argument("--tokens", type=Path, metavar="JSON", help="a JSON list of token ids to answer for")
    parser.add_argument("--namespace", metavar="JSON", help="the key space: CacheNamespace's fields as JSON")
    parser.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk (the server's; 256)")
    parser.add_argument("--hash-algo", choices=["blake3", "sha256"], default="blake3", help="the server's")
    parser.add_argument("--json", action="store_true", help="print the answer as JSON")
    parser.set_defaults(run=lambda args, argv, console: run_events(args, console))


def run_events(args: argparse.Namespace, console: Console) -> int:
    from kvferry.client.event_index import EventIndex, EventSubscriber
    from kvferry.config import KvferryConfig

    try:
        streams = [parse_stream(spec) for spec in args.streams]
        keys = prompt_keys(args) if args.tokens is not None else None
        curve = KvferryConfig.load().security.client_curve()  # KVFERRY_SECURITY__* (docs/security.md)
    except ValueError as exc:
        console.print(f"kvferry events: {exc}")
        return 2
    index = EventIndex()
    subscriber = EventSubscriber(streams, index, curve=curve)
    try:
        end = time.monotonic() + args.seconds
        while (left := end - time.monotonic()) > 0:
            subscriber.poll(min(left, 0.5))
    finally:
        subscriber.close()
    answer: dict[str, Any] = {
        "held": index.summary(),
        "stale": sorted(index.stale),
        "streams": {s.node: {"last_seq": s.last_seq, "gaps": s.gaps} for s in streams},
    }
    if keys is not None:
        answer["prefix_tokens"] = {
            node: {medium: chunks * args.chunk_size for medium, chunks in media.items()}
            for node, media in index.longest_prefix(keys).items()
        }
    if args.json:
        console.print_json(json.dumps(answer))
    else:
        _print_table(console, answer)
    return 0


def parse_stream(spec: str) -> Any:
    """``[NODE=]PUB[,REPLAY]`` as a `Stream`; ValueError naming what is wrong."""
    from kvferry.client.event_index import Stream

    node, _, endpoints = spec.rpartition("=") if "=" in spec.split(",")[0] else ("", "", spec)
    pub, _, replay = endpoints.partition(",")
    for endpoint in (pub, replay):
        if endpoint and "://" not in endpoint:
            raise ValueError(f"{endpoint!r} in {spec!r} is not a ZMQ endpoint (tcp://HOST:PORT)")
    if not pub:
        raise ValueError(f"{spec!r} names no PUB endpoint")
    return Stream(node or pub, pub, replay or None)


def prompt_keys(args: argparse.Namespace) -> list[bytes]:
    """The chunk keys of ``--tokens`` in ``--namespace``, as the cache computes them."""
    from kvferry.cache.keys import CacheNamespace, ChunkHasher

    if args.namespace is None:
        raise ValueError("--tokens needs --namespace (the key space the server keys these tokens in)")
    try:
        tokens = json.loads(args.tokens.read_text())
        namespace = CacheNamespace(**json.loads(args.namespace))
    except (OSError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--tokens / --namespace: {exc}") from None
    return ChunkHasher(args.chunk_size, args.hash_algo).keys(tokens, namespace)


def _print_table(console: Console, answer: dict[str, Any]) -> None:
    table = Table("node", "medium", "chunks held", "prefix tokens held")
    prefix = answer.get("prefix_tokens", {})
    for node, media in sorted(answer["held"].items()):
        for medium, count in sorted(media.items()):
            table.add_row(node, medium, str(count), str(prefix.get(node, {}).get(medium, "")))
    console.print(table)
    for node, state in answer["streams"].items():
        stale = " (stale: lost events no replay could fill)" if node in answer["stale"] else ""
        console.print(f"{node}: last batch {state['last_seq']}, {state['gaps']} gaps{stale}")

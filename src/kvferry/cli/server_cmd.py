"""`kvferry server`: the flags, config and main loop come from `kvferry.server`, imported only when asked for.

Importing the server pulls in ZMQ, the cache engine and the tiers; `kvferry bench` and `kvferry formats` should not
pay for that, so the server's flags are attached to the parser only when the command is `server`.
"""

from __future__ import annotations

import argparse
import logging
import textwrap

SERVER_DESCRIPTION = (
    "Run one kvferry cache process that many engine processes share over ZMQ (loopback by default). "
    "Flags override KVFERRY_* environment variables, which override the --config YAML file."
)
SERVER_EXAMPLES = """\
examples:
  kvferry server                                         # 127.0.0.1:5555, HTTP /health /metrics /stats on 5556
  kvferry server --l1-size-gb 8 --port 5555 --chunk-size 256 --eviction lru
  kvferry server --l2 disk:/var/cache/kvferry?size=200GB --l2 redis://127.0.0.1:6379
  kvferry server --config kvferry.yaml --log-level DEBUG
"""


def add_server_parser(
    subparsers: argparse._SubParsersAction, with_flags: bool, formatter: type[argparse.HelpFormatter]
) -> None:
    parser = subparsers.add_parser(
        "server",
        help="run the shared cache server",
        description=textwrap.fill(SERVER_DESCRIPTION, width=100),
        epilog=SERVER_EXAMPLES,
        formatter_class=formatter,
    )
    if with_flags:
        from kvferry.server import add_server_arguments

        add_server_arguments(parser)
    parser.set_defaults(run=run_server, parser=parser)


def run_server(args: argparse.Namespace) -> int:
    from kvferry.server.app import config_or_exit, main

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return main(config_or_exit(args.parser, args))

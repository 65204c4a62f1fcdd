"""`kvferry`: benchmarks, the formats table and the cache server behind one command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rich.console import Console

from kvferry import __version__
from kvferry.cli.bench_cmd import add_bench_parser, chosen_benchmark
from kvferry.cli.config_cmd import add_config_parser
from kvferry.cli.events_cmd import add_events_parser
from kvferry.cli.formats_cmd import add_formats_arguments, run_formats
from kvferry.cli.keys_cmd import add_keys_parser
from kvferry.cli.server_cmd import add_server_parser

DESCRIPTION = """\
kvferry moves an LLM serving engine's paged KV cache (block-scattered, in the engine's own layout) into
contiguous chunk objects in a host memory pool and back, spills them to disk and Redis, and shares them
between engine processes through one cache server."""

EXAMPLES = """\
examples:
  kvferry bench transfer                        # GB/s of the CPU path vs a same-run memcpy (llama3-8b shape)
  kvferry bench transfer --device cuda --json bench-out/transfer.json
  kvferry bench --help                          # every benchmark: cache, pool, tiers, server, GPU, vLLM
  kvferry formats                               # every engine KV layout kvferry knows
  kvferry server --l1-size-gb 8 --port 5555     # the shared cache server
  kvferry config                                # the configuration kvferry would run with here
  kvferry keys server --dir /etc/kvferry        # a CURVE key pair (docs/security.md)
  kvferry events tcp://127.0.0.1:5557           # which node holds which prefix, from KV event streams

Run `kvferry COMMAND --help` for a command's options."""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keep the examples' line breaks; leave room for long option names."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)


def build_parser(with_server_flags: bool = False, bench: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; the server's flags and benchmark `bench`'s flags only when asked for (importing
    them costs the server's and that benchmark's imports)."""
    parser = argparse.ArgumentParser(
        prog="kvferry", description=DESCRIPTION, epilog=EXAMPLES, formatter_class=_Formatter
    )
    parser.add_argument("--version", action="version", version=f"kvferry {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    add_bench_parser(commands, bench, _Formatter)

    formats = commands.add_parser(
        "formats",
        help="list the engine KV layouts (EngineKVFormat)",
        description="Every engine KV layout kvferry moves, as declared in kvferry.formats.LAYOUTS.",
        epilog="examples:\n  kvferry formats\n  kvferry formats --markdown",
        formatter_class=_Formatter,
    )
    add_formats_arguments(formats)
    formats.set_defaults(run=lambda args, argv, console: run_formats(args, console))

    add_config_parser(commands, _Formatter)
    add_keys_parser(commands, _Formatter)
    add_events_parser(commands, _Formatter)
    add_server_parser(commands, with_server_flags, _Formatter)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args_list if not a.startswith("-")), None)
    parser = build_parser(command == "server", chosen_benchmark(args_list))
    args = parser.parse_args(args_list)
    if command == "server":
        return args.run(args)
    console = Console()
    if not console.is_terminal:  # piped or captured: no terminal width to fit, keep table rows whole
        console = Console(width=160)
    return args.run(args, args_list, console)

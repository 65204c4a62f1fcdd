"""`kvferry keys NAME`: a new CURVE key pair for a server or a client (docs/security.md)."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from kvferry.security import write_key_pair


def add_keys_parser(commands: Any, formatter: type[argparse.HelpFormatter]) -> None:
    parser = commands.add_parser(
        "keys",
        help="write a new CURVE key pair (NAME.key to hand out, NAME.key_secret to keep)",
        description="A new CURVE key pair as ZMQ certificates: DIR/NAME.key holds the public key (give it to the "
        "other side), DIR/NAME.key_secret both keys (owner-only; point security.curve_secret_key_file or "
        "client_secret_key_file at it). Existing files are never overwritten.",
        epilog="examples:\n  kvferry keys server --dir /etc/kvferry\n  kvferry keys node7 --dir /etc/kvferry/clients",
        formatter_class=formatter,
    )
    parser.add_argument("name", help="the key pair's file name (e.g. the host's name)")
    parser.add_argument("--dir", default=".", help="where to write the two files (default: here)")
    parser.set_defaults(run=lambda args, argv, console: run_keys(args, console))


def run_keys(args: argparse.Namespace, console: Console) -> int:
    try:
        public, secret = write_key_pair(args.dir, args.name)
    except (OSError, ValueError) as exc:
        console.print(f"kvferry keys: {exc}", markup=False, highlight=False, soft_wrap=True)
        return 2
    key = public.read_text(encoding="utf-8").split('public-key = "', 1)[1].split('"', 1)[0]
    console.print(f"public key {key}\n  {public}  (hand it out)\n  {secret}  (keep it: owner-only)", markup=False)
    return 0

"""`kvferry server`: command-line flags, the effective-config banner, and running until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from pydantic import ValidationError

from kvferry.cache import CacheEngine
from kvferry.config import KvferryConfig
from kvferry.kernels.cpu_threads import usable_cpus, use_own_threads
from kvferry.server.auth import check_exposure
from kvferry.server.server import KvferryServer, ServerStartError
from kvferry.stopping import join_thread
from kvferry.transfer import configure_gpu

log = logging.getLogger("kvferry.server")

STOP_DEADLINE_S = 8.0  # from the first signal to the exit, whatever is stuck: a supervisor's kill timer is ~10 s

# flag dest -> (config section, field); a flag left unset keeps the YAML/env/default value.
_FLAG_FIELDS: dict[str, tuple[str, str]] = {
    "host": ("server", "host"),
    "port": ("server", "port"),
    "ipc": ("server", "ipc_path"),
    "http_port": ("server", "http_port"),
    "heartbeat_interval": ("server", "heartbeat_interval_s"),
    "heartbeat_timeout": ("server", "heartbeat_timeout_s"),
    "transfer_workers": ("server", "transfer_workers"),
    "copy_threads": ("server", "copy_threads"),
    "tier_workers": ("server", "tier_workers"),
    "tier_check_interval": ("server", "tier_check_interval_s"),
    "busy_poll_us": ("server", "busy_poll_us"),
    "events_port": ("server", "events_port"),
    "events_replay_port": ("server", "events_replay_port"),
    "chunk_size": ("cache", "chunk_size"),
    "l1_size_gb": ("cache", "l1_size_gb"),
    "eviction": ("cache", "eviction_policy"),
    "shared_pool": ("cache", "shared_pool"),
}


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `kvferry server`; each overrides the config file and KVFERRY_* environment."""
    parser.add_argument("--config", metavar="YAML", help="config file (sections cache, tiers, server)")
    net = parser.add_argument_group("network")
    net.add_argument("--host", help="address to bind (default 127.0.0.1: loopback only)")
    net.add_argument("--port", type=int, help="ZMQ port for clients (default 5555; 0 = any free port)")
    net.add_argument("--http-port", type=int, help="HTTP port for /health /metrics /stats (default 5556)")
    net.add_argument("--ipc", metavar="PATH", help="also listen on this Unix socket (clients connect to ipc://PATH)")
    net.add_argument("--no-http", action="store_true", help="do not open the HTTP side port")
    net.add_argument("--heartbeat-interval", type=float, metavar="S", help="client heartbeat period (s)")
    net.add_argument("--heartbeat-timeout", type=float, metavar="S", help="end silent sessions after (s)")
    net.add_argument("--max-message-mb", type=float, metavar="MB", help="largest request frame (MiB)")
    net.add_argument("--transfer-workers", type=int, metavar="N", help="threads running transfers")
    net.add_argument("--copy-threads", type=int, metavar="N", help="threads copying CPU KV (default: one per CPU)")
    net.add_argument("--tier-workers", type=int, metavar="N", help="threads finishing lookups that ask a tier")
    net.add_argument("--tier-check-interval", type=float, metavar="S", help="probe each tier this often (s)")
    net.add_argument(
        "--busy-poll-us", type=int, metavar="US", help="after each request, poll without sleeping this long (us)"
    )
    net.add_argument("--events-port", type=int, metavar="PORT", help="publish KV events on this ZMQ PUB port (off)")
    net.add_argument("--events-replay-port", type=int, metavar="PORT", help="replay KV events on this ROUTER port")
    cache = parser.add_argument_group("cache")
    cache.add_argument("--chunk-size", type=int, metavar="TOKENS", help="tokens per chunk object")
    cache.add_argument("--l1-size-gb", type=float, metavar="GB", help="host pool capacity (GiB)")
    cache.add_argument("--eviction", choices=["lru", "s3fifo"], help="eviction policy")
    cache.add_argument(
        "--shared-pool",
        action="store_true",
        default=None,
        help="keep the pool in shared memory: engines of this user on this host copy located objects themselves",
    )
    cache.add_argument(
        "--l2",
        action="append",
        metavar="URL",
        help="storage tier below the pool (disk:/path?size=200GB, redis://host:port); repeat for more",
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def config_from_args(args: argparse.Namespace) -> KvferryConfig:
    """Defaults, then --config YAML, then KVFERRY_* environment, then the flags given on the command line."""
    overrides: dict[str, Any] = {}
    for dest, (section, field) in _FLAG_FIELDS.items():
        value = getattr(args, dest, None)
        if value is not None:
            overrides.setdefault(section, {})[field] = value
    if getattr(args, "no_http", False):
        overrides.setdefault("server", {})["http_port"] = None
    if getattr(args, "max_message_mb", None) is not None:
        overrides.setdefault("server", {})["max_message_bytes"] = int(args.max_message_mb * 2**20)
    if getattr(args, "l2", None):
        overrides["tiers"] = list(args.l2)
    return KvferryConfig.load(getattr(args, "config", None), overrides=overrides)


def config_or_exit(parser: argparse.ArgumentParser, args: argparse.Namespace) -> KvferryConfig:
    """`config_from_args`, or exit 2 with one line naming the setting at fault (no traceback, no usage dump)."""
    try:
        return config_from_args(args)
    except ValueError as exc:  # pydantic's ValidationError is a ValueError: it names the bad field
        parser.exit(2, f"{parser.prog}: error: {one_line(exc)}\n")


def one_line(exc: ValueError) -> str:
    """A config error on one line: each pydantic error as `field: message`, anything else as it is."""
    if isinstance(exc, ValidationError):
        problems = []
        for err in exc.errors():
            where = ".".join(str(part) for part in err["loc"])
            message = str(err["msg"]).removeprefix("Value error, ")
            problems.append(f"{where}: {message}" if where else message)
        return "; ".join(problems)
    return " ".join(str(exc).split())


def main(config: KvferryConfig) -> int:
    """Serve until SIGINT/SIGTERM, then release every session and port; returns the exit status (2: the server
    could not start, said in one line: a tier it cannot open, a pool it cannot allocate, a port in use)."""
    log.info("kvferry server starting with config %s", json.dumps(config.shown()))
    use_own_threads(config.server.copy_threads or usable_cpus())
    configure_gpu(**config.transfer.engine_settings())  # the process's GPU data path: the server owns its process
    try:
        check_exposure(config.server, config.security)  # before the pool is allocated, which may take seconds
        engine = CacheEngine(config, name="server")
    except ServerStartError as exc:  # a listener beyond loopback without credentials
        log.error("kvferry server cannot start: %s", exc)
        return 2
    except (ValueError, OSError, MemoryError) as exc:  # tier URLs and directories, the pool's size: named
        log.debug("cache engine construction failed", exc_info=exc)
        log.error("kvferry server cannot start: %s", exc)
        return 2
    server = KvferryServer(config.server, engine, security=config.security)
    try:
        server.start()
    except (ServerStartError, zmq.ZMQError) as exc:
        log.error("kvferry server cannot start: %s", exc)
        server.stop()
        engine.close()
        return 2
    http = f"http://{config.server.host}:{server.http_port}" if server.http_port is not None else "off"
    signals = StopSignals()
    # Handlers before the "ready" line: whoever waits for it may signal at once.
    previous = {sig: signal.signal(sig, signals.handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    extra = f" ipc={server.ipc_endpoint}" if server.ipc_endpoint else ""
    if server.events_port is not None:
        extra += f" events=tcp://{config.server.host}:{server.events_port}"
        if server.events_replay_port is not None:
            extra += f" events_replay=tcp://{config.server.host}:{server.events_replay_port}"
    log.info("kvferry server ready: zmq=tcp://%s:%d http=%s%s", config.server.host, server.port, http, extra)
    try:
        while not signals.received:
            time.sleep(0.1)  # a signal interrupts the sleep; its handler has run when the loop looks again
        log.info("kvferry server stopping (%s; a second one exits at once)", signal.Signals(signals.received[0]).name)
    finally:
        if not stop_within(server, engine, STOP_DEADLINE_S):
            log.error("kvferry server did not stop within %g s; exiting without it", STOP_DEADLINE_S)
            os._exit(1)  # a normal exit would wait for the pool threads still busy
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.info("kvferry server stopped")
    return 0


class StopSignals:
    """SIGINT/SIGTERM: the first asks for a clean stop, a second exits at once.

    A handler runs on the main thread between two of its bytecodes, even inside a `threading` call holding a lock:
    one that takes a lock (`threading.Event.set`) deadlocks when the signal lands while the main thread holds that
    very lock (inside `Event.wait`). So the handler only appends to a list, and the main thread polls it.
    """

    def __init__(self, exit_now: Callable[[int], object] = os._exit) -> None:
        self.received: list[int] = []
        self._exit_now = exit_now

    def handle(self, signum: int, _frame: object) -> None:
        if self.received:
            self._exit_now(128 + signum)  # the operator does not want to wait for the clean stop
        self.received.append(signum)


def stop_within(server: KvferryServer, engine: CacheEngine, timeout_s: float) -> bool:
    """Stop the server, then close the engine (its tiers), on a thread of their own waited for at most `timeout_s`;
    True if both finished and no thread they ran is left (a tier that stopped answering holds the engine's)."""
    deadline = time.monotonic() + timeout_s
    clean: list[bool] = []

    def stop() -> None:
        clean.append(server.stop(timeout_s=max(0.0, timeout_s - 2.0)))  # the rest is for the engine's tiers
        engine.close()
        clean.append(True)

    stopping = threading.Thread(target=stop, name="kvferry-stop", daemon=True)
    stopping.start()
    return join_thread(stopping, deadline) and all(clean) and len(clean) == 2


def run_from_command_line(argv: list[str] | None = None) -> int:
    """`python -m kvferry.server [flags]`: what `kvferry server` runs."""
    parser = argparse.ArgumentParser(prog="kvferry server", description=__doc__)
    add_server_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return main(config_or_exit(parser, args))

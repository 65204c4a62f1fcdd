"""A `kvferry server` in a process of its own, as the benchmarks start one (`python -m kvferry.server` on a free port,
ready once it logs so), the server's busy polling as a benchmark's option, and whether CUDA MPS ran beside it."""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import threading

from kvferry.bench.harness import BenchError, child_env
from kvferry.cuda.mps import mps_pipe_directory, mps_running

READY_TIMEOUT_S = 120.0


class ServerProcess:
    """`python -m kvferry.server` on a free port; `endpoint` is its TCP one, or its Unix socket's with `ipc_path`."""

    def __init__(
        self,
        pool_gb: float,
        busy_poll_us: int = 0,
        ipc_path: str | None = None,
        *,
        chunk_size: int,
        security: dict[str, str] | None = None,
        events: bool = False,
        shared_pool: bool = False,
    ) -> None:
        """`chunk_size`: the server's, the bench's KV's; `security`: KVFERRY_SECURITY__ variables of the server (its
        CURVE keys); `events`: it publishes its KV events (`events_endpoints`: PUB, REPLAY); `shared_pool`: its
        pool in shared memory, for direct loads."""
        cmd = [sys.executable, "-m", "kvferry.server", "--port", "0", "--no-http", "--chunk-size", str(chunk_size)]
        cmd += ["--l1-size-gb", str(pool_gb), "--busy-poll-us", str(busy_poll_us), "--log-level", "INFO"]
        cmd += ["--ipc", ipc_path] if ipc_path else []
        cmd += ["--events-port", "0", "--events-replay-port", "0"] if events else []
        cmd += ["--shared-pool"] if shared_pool else []
        self.proc = subprocess.Popen(cmd, env=child_env(security), stderr=subprocess.PIPE, text=True)
        assert self.proc.stderr is not None
        watchdog = threading.Timer(READY_TIMEOUT_S, self.proc.kill)  # a server never ready ends the loop below
        watchdog.start()
        try:
            for line in self.proc.stderr:
                ready = line.partition("kvferry server ready: ")[2]
                if ready:
                    fields = dict(re.findall(r"(\w+)=(\S+)", ready))
                    self.endpoint = fields.get("ipc") or fields["zmq"]
                    self.tcp_endpoint = fields["zmq"]
                    self.events_endpoints = (fields.get("events"), fields.get("events_replay"))
                    break
            else:
                self.proc.wait()
                raise BenchError(f"the server exited (status {self.proc.returncode}) before it was ready")
        finally:
            watchdog.cancel()
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=60)


def add_busy_poll_argument(parser: argparse.ArgumentParser) -> None:
    """The server's ``--busy-poll-us`` as a benchmark's option (`check_busy_poll`)."""
    parser.add_argument(
        "--busy-poll-us",
        type=int,
        default=0,
        metavar="US",
        help="the server's --busy-poll-us: how long its socket thread polls without sleeping after each request, so "
        "that the next one finds it awake (default: %(default)s)",
    )


def check_busy_poll(args: argparse.Namespace) -> None:
    if args.busy_poll_us < 0:
        raise BenchError(f"--busy-poll-us must be >= 0, got {args.busy_poll_us}")
    if args.busy_poll_us and getattr(args, "no_server", False):
        raise BenchError("--busy-poll-us is the server's, and --no-server starts none")


def mps_line() -> str:
    """Whether this process and a server it started were CUDA MPS clients (`kvferry.cuda.mps`), as a GPU benchmark
    prints it under its table: it moves the server's rows (docs/server.md)."""
    where = mps_pipe_directory()
    if mps_running():
        return (
            f"CUDA MPS on (a control daemon in {where}): the GPU work of this process and of its servers shared the "
            "GPU, their streams one pool of its work queues"
        )
    return f"CUDA MPS off (no control daemon in {where}): the GPU time-sliced this process's work and its servers'"

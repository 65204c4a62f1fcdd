"""A real Mooncake master and HTTP metadata server on loopback, for the Mooncake tier's tests (and the server's)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.ports import free_ports

MASTER = shutil.which("mooncake_master")
METADATA = shutil.which("mooncake_http_metadata_server")
NO_MOONCAKE_REASON = "mooncake_master not on PATH (pip install 'kvferry[mooncake]'; apt-get install -y libibverbs1)"
# CI installs the wheel: there a missing one fails the tests rather than skipping them.
REQUIRED = os.environ.get("KVF_TEST_MOONCAKE_REQUIRED") == "1"


def need_mooncake() -> None:
    """Skip the calling test where the wheel is absent, unless the run requires it (then fail)."""
    if MASTER and METADATA:
        return
    if REQUIRED:
        pytest.fail(NO_MOONCAKE_REASON + " (KVF_TEST_MOONCAKE_REQUIRED=1)")
    pytest.skip(NO_MOONCAKE_REASON)


def _wait_listening(port: int, process: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"{what} did not listen on port {port}")


class MooncakeStore:
    """``mooncake_master`` (start/kill/restart at will; its index lives in memory) and the metadata server,
    each bound to 127.0.0.1."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.rpc_port, self.metrics_port, self.metadata_port = free_ports(3)
        self.master: subprocess.Popen[bytes] | None = None
        self.metadata: subprocess.Popen[bytes] | None = None

    def url(self, **params: str) -> str:
        query = "".join(f"&{name}={value}" for name, value in params.items())
        return f"mooncake://127.0.0.1:{self.rpc_port}?metadata=http://127.0.0.1:{self.metadata_port}/metadata{query}"

    def start(self) -> MooncakeStore:
        assert METADATA is not None
        log = open(self.workdir / "metadata.log", "ab")  # noqa: SIM115 -- the child writes it until killed
        cmd = [METADATA, "--host", "127.0.0.1", "--port", str(self.metadata_port), "--log-level", "WARNING"]
        self.metadata = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_listening(self.metadata_port, self.metadata, "mooncake_http_metadata_server")
            return self.start_master()
        except BaseException:  # no caller gets the store to kill: what was started goes now
            self.kill()
            raise

    def start_master(self) -> MooncakeStore:
        assert MASTER is not None
        log = open(self.workdir / "master.log", "ab")  # noqa: SIM115
        cmd = [
            MASTER, "-rpc_address=127.0.0.1", f"-rpc_port={self.rpc_port}",
            "-metrics_host=127.0.0.1", f"-metrics_port={self.metrics_port}",
            "-client_ttl=2",  # a killed node's segment is unmounted after 2 s, not 10
        ]  # fmt: skip
        self.master = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        _wait_listening(self.rpc_port, self.master, "mooncake_master")
        return self

    def kill_master(self) -> None:
        if self.master is not None and self.master.poll() is None:
            self.master.send_signal(signal.SIGKILL)  # a stopped process dies of it too
            self.master.wait(timeout=10)
        self.master = None

    def freeze_master(self) -> None:
        """Stop the master, and return once the kernel shows it stopped (a signal is delivered asynchronously: a
        request sent at once could otherwise still be answered)."""
        assert self.master is not None
        self.master.send_signal(signal.SIGSTOP)
        stat = Path(f"/proc/{self.master.pid}/stat")
        deadline = time.monotonic() + 5
        while stat.read_text().rpartition(")")[2].split()[0] != "T":
            assert time.monotonic() < deadline, "mooncake_master did not stop"
            time.sleep(0.001)

    def thaw_master(self) -> None:
        assert self.master is not None
        self.master.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        self.kill_master()
        if self.metadata is not None and self.metadata.poll() is None:
            self.metadata.kill()
            self.metadata.wait(timeout=10)
        self.metadata = None

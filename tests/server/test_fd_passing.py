"""Driver-mapped KV passed by file descriptor: the server's descriptor socket (`kvferry.server.fd_inbox`), the
client's deposit (`kvferry.client.fd_deposit`) and the registration that maps what was deposited
(`kvferry.server.kv_mapping`), up to the driver's import, which a stand-in takes (no GPU here: the GPU run is
test_server_vmm_gpu.py). memfds stand in for the driver's exported allocations. Every descriptor the server
received is closed on every path: the process's open descriptors are counted (the inbox serves in this process).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvferry.client.errors import ServerUnavailable
from kvferry.client.fd_deposit import deposit_fds, export_kv_to
from kvferry.config import ServerConfig
from kvferry.cuda.driver import CudaError
from kvferry.protocol.fd_passing import FdPassingError, close_all, fd_socket_path, pack, receive
from kvferry.protocol.messages import ProtocolError
from kvferry.server import KvferryServer, fd_inbox, kv_mapping
from kvferry.server.fd_inbox import FdInbox
from kvferry.server.requests import RegisterArgs
from tests.server.serverkit import FakeEngine, wait_for


@pytest.fixture(scope="module")
def sock_path() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="kvf-fd-") as sockets:
        yield os.path.join(sockets, "server.sock")


@pytest.fixture(scope="module")
def inbox(sock_path: str) -> Iterator[FdInbox]:
    box = FdInbox(fd_socket_path(sock_path))
    yield box
    box.close()


def open_fds() -> dict[str, str]:
    """This process's open descriptors and what each is."""
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own
    return fds


def all_closed(before: dict[str, str], inbox: FdInbox) -> None:
    """Every descriptor the server received is closed, none waits in the inbox. (Waited for: the server closes its
    end of a deposit's connection just after it answers.)"""
    wait_for(lambda: open_fds() == before, f"the descriptors open before: {before}")
    assert inbox.pending() == 0


def memfds(contents: list[bytes]) -> list[int]:
    fds = []
    for content in contents:
        fds.append(os.memfd_create("kv"))
        os.write(fds[-1], content)
    return fds


def deposit(sock_path: str, contents: list[bytes]) -> bytes:
    fds = memfds(contents)
    try:
        return deposit_fds(f"ipc://{sock_path}", fds)
    finally:
        close_all(fds)


def test_a_deposit_reaches_the_inbox_as_the_same_files_and_is_taken_once(sock_path: str, inbox: FdInbox) -> None:
    before = open_fds()
    contents = [os.urandom(32) for _ in range(300)]  # two messages
    token = deposit(sock_path, contents)
    fds = inbox.take(token)
    try:
        assert [os.pread(fd, 32, 0) for fd in fds] == contents
    finally:
        close_all(fds)
    with pytest.raises(KeyError):
        inbox.take(token)
    all_closed(before, inbox)


def test_a_peer_killed_mid_deposit_leaves_no_descriptor_open(sock_path: str, inbox: FdInbox) -> None:
    before = open_fds()
    script = f"""
import os, signal, socket, msgpack
sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
sock.connect({fd_socket_path(sock_path)!r})
fds = [os.memfd_create("kv") for _ in range(10)]
socket.send_fds(sock, [msgpack.packb({{"total": 20}})], fds)
os.kill(os.getpid(), signal.SIGKILL)
"""
    proc = subprocess.run([sys.executable, "-c", script], timeout=60)
    assert proc.returncode == -9
    # The inbox serves one connection at a time, in order: once a later deposit is answered, the dead one is done.
    close_all(inbox.take(deposit(sock_path, [b"after"])))
    all_closed(before, inbox)


def _raw_deposit(sock_path: str, messages: list[tuple[bytes, int]]) -> dict[str, Any]:
    """Send each (payload, number of memfds) as one message; the server's answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(10)
        sock.connect(fd_socket_path(sock_path))
        for payload, count in messages:
            fds = memfds([b"m"] * count)
            socket.send_fds(sock, [payload], fds)
            close_all(fds)
        answer, extra = receive(sock)
        close_all(extra)
        return answer


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([(pack({"total": 2}), 3)], "3 descriptors after a message announcing 2"),
        ([(pack({"total": 3}), 2), (pack({"total": 4}), 1)], "one count"),
        ([(pack({"total": 0}), 1)], "one count"),
        ([(pack({"total": "2"}), 2)], "one count"),
        ([(pack({"total": 2}), 0)], "0 descriptors"),
        ([(b"\xc1", 2)], "not msgpack"),
        ([(os.urandom(400), 2)], "over 256 bytes"),
    ],
    ids=["too-many", "changed-total", "zero", "not-int", "no-fds", "malformed", "oversized"],
)
def test_a_bad_deposit_is_refused_with_the_reason_and_closed(
    sock_path: str, inbox: FdInbox, messages: list[tuple[bytes, int]], error: str
) -> None:
    before = open_fds()
    answer = _raw_deposit(sock_path, messages)
    assert error in answer["error"]
    all_closed(before, inbox)


def test_another_user_s_deposit_is_refused(sock_path: str, inbox: FdInbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fd_inbox, "_peer_uid", lambda conn: os.getuid() + 1)
    before = open_fds()
    with pytest.raises(FdPassingError, match="uid"):
        deposit(sock_path, [b"a", b"b"])
    all_closed(before, inbox)


def test_an_expired_deposit_is_closed_untaken(sock_path: str, inbox: FdInbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fd_inbox, "DEPOSIT_TTL_S", 0.0)
    before = open_fds()
    token = deposit(sock_path, [b"old"])
    with pytest.raises(KeyError):
        inbox.take(token)
    all_closed(before, inbox)


def test_closing_the_inbox_closes_what_waits_in_it_and_its_socket() -> None:
    with tempfile.TemporaryDirectory(prefix="kvf-fd-") as sockets:
        path = os.path.join(sockets, "other.sock")
        before = open_fds()
        box = FdInbox(fd_socket_path(path))
        deposit(path, [b"one", b"two"])
        assert box.pending() == 2
        box.close()
        box.close()
        assert open_fds() == before and not os.path.exists(fd_socket_path(path))
        with pytest.raises(ServerUnavailable):
            deposit(path, [b"late"])


def test_a_client_without_the_unix_socket_cannot_deposit(sock_path: str) -> None:
    fds = memfds([b"x"])
    try:
        with pytest.raises(ValueError, match="ipc://PATH"):
            deposit_fds("tcp://127.0.0.1:5555", fds)
        with pytest.raises(ServerUnavailable, match="cannot pass descriptors"):
            deposit_fds(f"ipc://{sock_path}.absent", fds)
    finally:
        close_all(fds)


def test_cpu_tensors_need_no_deposit() -> None:
    storages, _ = export_kv_to("tcp://127.0.0.1:5555", [torch.randn(4, 8)])
    assert [s["kind"] for s in storages] == ["shm_fd"]


class FakeAllocation:
    """The driver's import, as `ImportedAllocation` is called: what it read from the descriptor it was given."""

    calls: list[tuple[bytes, int, int, int]] = []

    def __init__(self, fd: int, nbytes: int, device: int, context: int) -> None:
        FakeAllocation.calls.append((os.pread(fd, 16, 0), nbytes, device, context))
        self.nbytes = nbytes


@pytest.fixture
def fake_driver(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bytes, int, int, int]]:
    FakeAllocation.calls = []
    monkeypatch.setattr(kv_mapping.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kv_mapping, "_device_by_uuid", lambda uuid, where: 3)
    monkeypatch.setattr(kv_mapping, "primary_context", lambda device: 0xC0)
    monkeypatch.setattr(kv_mapping, "ImportedAllocation", FakeAllocation)
    monkeypatch.setattr(kv_mapping, "as_byte_tensor", lambda a: torch.zeros(a.nbytes, dtype=torch.uint8))
    return FakeAllocation.calls


def vmm_args(token: bytes, fd_indexes: list[int], nbytes: int = 4096) -> RegisterArgs:
    storages = [{"kind": "cuda_vmm_fd", "device_uuid": "GPU-x", "token": token, "fd_index": i, "nbytes": nbytes}
                for i in fd_indexes]  # fmt: skip
    kv = [{"storage": s, "offset": 256, "shape": [4, 16], "stride": [16, 1], "dtype": "bfloat16"}
          for s in range(len(storages))]  # fmt: skip
    return RegisterArgs.model_validate({"format": 1, "namespace": {"model": "m"}, "storages": storages, "kv": kv})


def test_a_registration_maps_each_deposited_allocation_and_closes_every_descriptor(
    sock_path: str, inbox: FdInbox, fake_driver: list[tuple[bytes, int, int, int]]
) -> None:
    before = open_fds()
    contents = [os.urandom(16) for _ in range(3)]
    token = deposit(sock_path, contents)
    mapped = kv_mapping.map_kv(vmm_args(token, [2, 0, 1]), inbox)
    assert fake_driver == [(contents[i], 4096, 3, 0xC0) for i in (2, 0, 1)]
    assert [t.shape for t in mapped.paged] == [(4, 16)] * 3 and mapped.paged[0].dtype == torch.bfloat16
    assert [t.storage_offset() for t in mapped.paged] == [256] * 3
    all_closed(before, inbox)
    with pytest.raises(ProtocolError, match="no such deposit"):
        kv_mapping.map_kv(vmm_args(token, [0]), inbox)


@pytest.mark.parametrize(
    ("fd_indexes", "nbytes", "error"),
    [([0, 5], 4096, "'storages\\[1\\].fd_index'=5 is outside the deposit's 2"), ([0], 512, "reaches byte 640")],
)
def test_a_registration_that_misnames_its_allocations_is_refused_and_closes_the_deposit(
    sock_path: str,
    inbox: FdInbox,
    fake_driver: list[tuple[bytes, int, int, int]],
    fd_indexes: list[int],
    nbytes: int,
    error: str,
) -> None:
    before = open_fds()
    token = deposit(sock_path, [b"a", b"b"])
    with pytest.raises(ProtocolError, match=error):
        kv_mapping.map_kv(vmm_args(token, fd_indexes, nbytes), inbox)
    all_closed(before, inbox)


def test_a_driver_refusal_is_a_bad_argument_naming_it(
    sock_path: str, inbox: FdInbox, fake_driver: list[tuple[bytes, int, int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object) -> None:
        raise CudaError("cuMemImportFromShareableHandle failed: CUDA_ERROR_INVALID_VALUE (1)")

    monkeypatch.setattr(kv_mapping, "ImportedAllocation", refuse)
    before = open_fds()
    token = deposit(sock_path, [b"a"])
    with pytest.raises(ProtocolError, match=r"cannot map the passed CUDA allocation.*CUDA_ERROR_INVALID_VALUE"):
        kv_mapping.map_kv(vmm_args(token, [0]), inbox)
    all_closed(before, inbox)


def test_passed_allocations_need_the_descriptor_socket() -> None:
    with pytest.raises(ProtocolError, match="no --ipc socket"):
        kv_mapping.map_kv(vmm_args(os.urandom(16), [0]), None)


@pytest.mark.parametrize(
    ("field", "value"), [("token", b"short"), ("nbytes", 0), ("fd_index", -1), ("kind", "cuda_vmm")]
)
def test_the_wire_description_is_checked(field: str, value: object) -> None:
    storage = {"kind": "cuda_vmm_fd", "device_uuid": "GPU-x", "token": os.urandom(16), "fd_index": 0, "nbytes": 1}
    RegisterArgs.model_validate({"format": 1, "namespace": {"model": "m"}, "storages": [storage], "kv": []})
    with pytest.raises(ValueError, match="storages"):
        RegisterArgs.model_validate(
            {"format": 1, "namespace": {"model": "m"}, "storages": [{**storage, field: value}], "kv": []}
        )


def test_a_server_with_a_unix_socket_takes_descriptors_beside_it() -> None:
    with tempfile.TemporaryDirectory(prefix="kvf-fd-") as sockets:
        path = os.path.join(sockets, "server.sock")
        server = KvferryServer(ServerConfig(port=0, http_port=None, ipc_path=path), FakeEngine())
        server.start()
        try:
            assert len(deposit(path, [b"kv"])) == 16
        finally:
            server.stop()
        assert not os.path.exists(fd_socket_path(path))

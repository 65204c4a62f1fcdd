"""The server's request handling and session isolation, in one process over the fake engine."""

from __future__ import annotations

import re
import time
from typing import Any

import numpy as np
import pytest
import torch

from kvferry.client import KvferryClient, ServerError
from kvferry.config import ServerConfig
from kvferry.protocol.messages import Op
from kvferry.server import KvferryServer
from tests.server.conftest import endpoint_of
from tests.server.serverkit import FakeEngine, random_kv, raw_request, shm_mappings, shm_name, wait_for

FMT = 3  # NL_X_NB_BS_HS: one layer of [NB, BS, W] is what the fake engine copies
NS = {"model": "fake-model"}


@pytest.fixture(params=["tcp", "ipc"])
def endpoint(request: pytest.FixtureRequest, server: KvferryServer) -> str:
    """Each test over TCP (ZMQ) and over the server's Unix socket (kvferry.server.unix_clients)."""
    return endpoint_of(server, request.param)


def test_handshake_reports_server_settings(client: KvferryClient, server: KvferryServer) -> None:
    hello = client.ping()
    assert hello["version"] == 1
    assert hello["chunk_size"] == client.chunk_size == client.get_chunk_size() == 4
    assert hello["heartbeat_timeout_s"] == server.config.heartbeat_timeout_s
    assert hello["session"] == client.session_id.hex()


def test_store_in_one_session_retrieve_in_another_bit_exact(endpoint: str, engine: FakeEngine) -> None:
    tokens = np.random.default_rng(0).integers(0, 50_000, size=10)  # 2 full chunks + a tail of 2
    source, target = random_kv(1), random_kv(2)
    with KvferryClient(endpoint) as writer, KvferryClient(endpoint) as reader:
        reg_w = writer.register_kv_cache(source, FMT, namespace=NS)
        assert writer.store(reg_w, tokens, [5, 9, 3, 7, 1]) == 8
        reg_r = reader.register_kv_cache(target, FMT, namespace=NS)
        found = reader.lookup(tokens, registration=reg_r)
        assert (found.tokens, found.pending, found.lock) == (8, 0, None)
        # A process holding no KV (a scheduler) names the key space instead of a registration.
        key_space = {**NS, "kv_dtype": "torch.bfloat16", "layout": f"fake:{FMT}"}
        assert reader.lookup(tokens, namespace=key_space).tokens == 8
        assert reader.lookup(tokens, namespace={**key_space, "salt": "other"}).tokens == 0
        assert reader.retrieve(reg_r, tokens, [20, 21, 22, 23, 24]) == 8
    # the server wrote into the reader's own tensor through its shared-memory mapping
    assert torch.equal(target[0][20:24], source[0][[5, 9, 3, 7]])
    assert not torch.equal(target[0][24], source[0][1])


def test_registration_moves_cpu_kv_into_shared_memory_in_place(client: KvferryClient) -> None:
    buffer = random_kv(3)[0]
    layers = [buffer[:16], buffer[16:]]  # two views of one storage: registered as one shared storage
    before = buffer.clone()
    client.register_kv_cache(layers, FMT, namespace=NS)
    assert buffer.is_shared() and torch.equal(buffer, before)
    layers[1][0, 0, 0] = 7.0  # the views still alias the (moved) storage
    assert buffer[16, 0, 0] == 7.0


def test_registrations_are_private_to_their_session(endpoint: str) -> None:
    with KvferryClient(endpoint) as owner, KvferryClient(endpoint) as other:
        reg = owner.register_kv_cache(random_kv(5), FMT, namespace=NS)
        with pytest.raises(ServerError, match="UNKNOWN_REGISTRATION"):
            other.store(reg, list(range(4)), [0, 1])
        owner.unregister_kv_cache(reg)
        with pytest.raises(ServerError, match="UNKNOWN_REGISTRATION"):
            owner.store(reg, list(range(4)), [0, 1])


def test_bad_arguments_get_errors_naming_them(client: KvferryClient) -> None:
    reg = client.register_kv_cache(random_kv(6), FMT, namespace=NS)
    with pytest.raises(ServerError, match="block_ids has 1 entries"):  # the engine's ValueError
        client.store(reg, list(range(8)), [0])
    with pytest.raises(ServerError, match="'format'=999"):
        client.register_kv_cache(random_kv(7), 999, namespace=NS)
    with pytest.raises(ServerError, match=r"namespace\.model"):
        client.register_kv_cache(random_kv(7), FMT, namespace={"model": ""})
    reply = raw_request(client.endpoint, "LOOKUP", {"tokens": b""})
    assert reply["error"]["message"] == "give exactly one of 'registration' and 'namespace'"
    with pytest.raises(ValueError, match=r"tokens must be ids in \[0, 2\*\*32\)"):
        client.lookup([-1], registration=reg)
    with pytest.raises(TypeError, match="paged"):
        client.register_kv_cache({"k": 1}, FMT, namespace=NS)
    with pytest.raises(ValueError, match="exceeds the server's max_message_bytes=65536"):
        client.lookup(list(range(20_000)), registration=reg)  # refused before it is sent
    assert client.ping()["version"] == 1  # the session survived all of it


def test_pages_keys_go_with_pages_instead_of_tokens_and_whole(client: KvferryClient) -> None:
    """A transfer of pages may carry their 32-byte keys instead of their tokens (`page_keys`; the tokens spelled
    from them: tests/integrations/test_sglang_linker_tokens.py): refused beside tokens, without `pages`, when not
    whole keys, or where a chunk is too short to spell one (this server's 4 tokens)."""
    reg = client.register_kv_cache(random_kv(6), FMT, namespace=NS)
    base = {"registration": reg, "block_ids": np.arange(8, dtype="<u4").tobytes(), "pages": True}
    for op in ("STORE", "RETRIEVE"):
        for bad, match in [
            ({"tokens": b"\0" * 32, "page_keys": b"\1" * 32}, "instead of 'tokens'"),
            ({"tokens": b"", "page_keys": b"\1" * 32, "pages": False}, "go with 'pages'"),
            ({"tokens": b"", "page_keys": b"\1" * 33}, "32 bytes each, got 33"),
            ({"tokens": b"", "page_keys": b"\1" * 32}, "a page of 4 tokens cannot spell"),
        ]:
            reply = raw_request(client.endpoint, op, {**base, **bad})
            assert reply["error"]["code"] == "BAD_ARGUMENT" and "'page_keys'" in reply["error"]["message"]
            assert re.search(match, reply["error"]["message"])
    assert client.ping()["version"] == 1


def test_a_key_spaces_typed_fields_cross_the_wire(endpoint: str) -> None:
    tokens = np.random.default_rng(8).integers(0, 50_000, size=8)
    tags = {"group": "group=1:full", "split": "exact_layers=0", "kv_cache_dtype": "fp8_e4m3"}
    with KvferryClient(endpoint) as client:
        reg = client.register_kv_cache(random_kv(8), FMT, namespace={**NS, **tags})
        assert client.store(reg, tokens, [0, 1, 2, 3]) == 8
        key_space = {**NS, "kv_dtype": "torch.bfloat16", "layout": f"fake:{FMT}"}
        assert client.lookup(tokens, namespace={**key_space, **tags}).tokens == 8
        for name in tags:  # each field names a key space of its own
            assert client.lookup(tokens, namespace={**key_space, **tags, name: "other"}).tokens == 0
        # The same keys as the salt that earlier releases' connectors built from these fields
        legacy = "|group=1:full|exact_layers=0|kv_cache_dtype=fp8_e4m3"
        assert client.lookup(tokens, namespace={**key_space, "salt": legacy}).tokens == 8
        for bad, match in [
            ({"group": 1}, r"namespace\.group"),
            ({"split": ""}, r"namespace\.split"),
            ({"kv_cache_dtype": "fp8|e4m3"}, r"namespace\.kv_cache_dtype"),
            ({"tenant": "a"}, r"namespace\.tenant"),
        ]:
            with pytest.raises(ServerError, match=match):
                client.register_kv_cache(random_kv(9), FMT, namespace={**NS, **bad})
            with pytest.raises(ServerError, match=match):
                client.lookup(tokens, namespace={**key_space, **bad})
        assert client.ping()["version"] == 1  # the session survived all of it


def test_unregister_and_end_session_unmap_the_memory(client: KvferryClient, server: KvferryServer) -> None:
    kv = random_kv(8)
    first = client.register_kv_cache(kv, FMT, namespace=NS)
    name = shm_name(kv[0])
    assert shm_mappings(name) == 2  # the client's own storage and the server's mapping of it
    second = client.register_kv_cache(kv, FMT, namespace=NS)
    assert shm_mappings(name) == 3 and server.stats()["open_registrations"] == 2
    client.unregister_kv_cache(second)
    assert shm_mappings(name) == 2 and server.stats()["open_registrations"] == 1
    assert client.end_session()["registrations"] == 1
    assert shm_mappings(name) == 1 and server.stats()["open_registrations"] == 0
    with pytest.raises(ServerError, match="UNKNOWN_REGISTRATION"):
        client.store(first, list(range(4)), [0, 1])


def test_session_ended_mid_transfer_unmaps_after_the_transfer(
    client: KvferryClient, server: KvferryServer, engine: FakeEngine
) -> None:
    reg = client.register_kv_cache(random_kv(9), FMT, namespace=NS)
    engine.gate.clear()
    pending = client.store_async(reg, list(range(8)), [0, 1, 2, 3])
    assert engine.in_transfer.wait(5)
    released = client.end_session()  # answered on the socket thread while the store is held
    assert released["registrations"] == 1
    assert server.stats()["open_registrations"] == 1  # still mapped: the store is reading it
    engine.gate.set()
    assert pending.result(5) == 8
    wait_for(lambda: server.stats()["open_registrations"] == 0, "the store to finish and unmap")


def test_disconnect_releases_the_session(endpoint: str, server: KvferryServer, engine: FakeEngine) -> None:
    client = KvferryClient(endpoint)
    reg = client.register_kv_cache(random_kv(10), FMT, namespace=NS)
    client.store(reg, list(range(4)), [0, 1])
    client.lookup(list(range(4)), registration=reg, lock=True)
    client._conn.close(time.monotonic() + 5)  # the socket goes away without END_SESSION
    wait_for(lambda: server.stats()["open_registrations"] == 0 and not engine.locks, "disconnect release")
    assert server.metrics.sessions_ended.labels("disconnect")._value.get() == 1


def test_silent_session_times_out_but_heartbeats_keep_one_alive(
    endpoint: str, server: KvferryServer, engine: FakeEngine
) -> None:
    import zmq

    ctx = zmq.Context()
    silent = ctx.socket(zmq.DEALER)
    silent.connect(f"tcp://127.0.0.1:{server.port}")
    from kvferry.protocol.messages import Op, encode_request

    silent.send(encode_request(Op.PING, 1, {}))
    assert silent.poll(5000)
    silent.recv()
    with KvferryClient(endpoint) as live:
        reg = live.register_kv_cache(random_kv(11), FMT, namespace=NS)
        wait_for(lambda: len(server.stats()["sessions"]) == 1, "the silent session to time out")
        time.sleep(2 * server.config.heartbeat_timeout_s)
        assert live.store(reg, list(range(4)), [0, 1]) == 4  # the live one is still registered
    assert server.metrics.sessions_ended.labels("heartbeat")._value.get() == 1
    silent.close(linger=0)
    ctx.term()


def test_a_stall_inside_a_turn_of_the_loop_ends_no_session(
    engine: FakeEngine, server_config: ServerConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server stopped (SIGSTOP, swapped out) while handling a request, not while waiting for one: on resuming,
    its clients' silence is its own, and they get a whole heartbeat timeout to be heard before any is judged. (The
    clock jumps inside a PING's handler, as it would for a process stopped there.)"""
    jump = [0.0]
    server = KvferryServer(server_config, engine, clock=lambda: time.monotonic() + jump[0])  # type: ignore[arg-type]
    ping = server._handlers.table[Op.PING]
    stall = 10 * server_config.heartbeat_timeout_s

    def stalled_ping(*args: Any) -> Any:
        jump[0] += stall
        return ping(*args)

    server.start()
    try:
        with KvferryClient(f"tcp://127.0.0.1:{server.port}") as client:
            reg = client.register_kv_cache(random_kv(14), FMT, namespace=NS)
            monkeypatch.setitem(server._handlers.table, Op.PING, stalled_ping)
            client.ping()
            monkeypatch.setitem(server._handlers.table, Op.PING, ping)
            time.sleep(2 * server_config.heartbeat_timeout_s)  # its heartbeats go on meanwhile
            assert client.store(reg, list(range(4)), [0, 1]) == 4  # still registered
        assert server.metrics.sessions_ended.labels("heartbeat")._value.get() == 0
    finally:
        server.stop()


def test_server_stop_releases_every_session(endpoint: str, server: KvferryServer, engine: FakeEngine) -> None:
    client = KvferryClient(endpoint, timeout_s=1)
    reg = client.register_kv_cache(random_kv(12), FMT, namespace=NS)
    client.store(reg, list(range(4)), [0, 1])
    client.lookup(list(range(4)), registration=reg, lock=True)
    server.stop()
    assert server.stats()["open_registrations"] == 0 and not engine.locks
    with pytest.raises((TimeoutError, ConnectionError)):
        client.ping()
    client._conn.close(time.monotonic() + 5)


def test_prefetch_status_clear_and_stats(client: KvferryClient, engine: FakeEngine) -> None:
    tokens = list(range(300, 312))
    reg = client.register_kv_cache(random_kv(13), FMT, namespace=NS)
    client.store(reg, tokens, list(range(6)))
    prefetch = client.prefetch(tokens, registration=reg)
    status = client.prefetch_status(prefetch)
    assert (status.done, status.tokens, status.error) == (True, 12, None)
    with pytest.raises(ServerError, match="UNKNOWN_PREFETCH"):  # reported once, then forgotten
        client.prefetch_status(prefetch)
    stats = client.stats()
    assert stats["cache"] == {"objects": 3, "locks": 0} and stats["server"]["open_registrations"] == 1
    client.clear()
    assert client.lookup(tokens, registration=reg).tokens == 0


def test_ready_events_belong_to_transfers_of_cuda_registrations(client: KvferryClient) -> None:
    """A CUDA registration's STORE or RETRIEVE names which of its opened IPC events it recorded (`ready_slot`), or
    sends one of its own (`ready_event`); anywhere else the fields are refused by name (the GPU path itself:
    tests/server/test_server_gpu.py, tests/server/test_transfers_started.py)."""
    from kvferry.client.kv_export import export_kv
    from kvferry.protocol.messages import Op, pack_ids

    paged = random_kv(9)  # its shared memory stays open while the server maps it
    storages, kv = export_kv(paged)
    args = {"format": FMT, "namespace": NS, "storages": storages, "kv": kv, "ready_events": [b"\0" * 64]}
    reply = raw_request(client.endpoint, "REGISTER_KV_CACHE", args)
    assert "'ready_events' are only meaningful for a CUDA registration" in reply["error"]["message"]

    reg = client.register_kv_cache(random_kv(10), FMT, namespace=NS)
    transfer = {"registration": reg, "tokens": pack_ids(range(8), "t"), "block_ids": pack_ids([0, 1, 2, 3], "b")}
    for op in (Op.STORE, Op.RETRIEVE):
        with pytest.raises(ServerError, match="'ready_slot'=0, but the registration has 0 events"):
            client._conn.wait(client._conn.submit(op, {**transfer, "ready_slot": 0}))
        with pytest.raises(ServerError, match="'ready_event' is only meaningful for a CUDA registration"):
            client._conn.wait(client._conn.submit(op, {**transfer, "ready_event": b"\0" * 64}))
    assert client.store(reg, list(range(8)), [0, 1, 2, 3]) == 8  # the session is fine
    assert client.retrieve(reg, list(range(8)), [4, 5, 6, 7]) == 8


def test_a_busy_polling_server_serves_and_stops(engine: FakeEngine) -> None:
    from kvferry.config import ServerConfig

    config = ServerConfig(port=0, http_port=None, busy_poll_us=20_000)
    server = KvferryServer(config, engine)  # type: ignore[arg-type]
    server.start()
    try:
        with KvferryClient(f"tcp://127.0.0.1:{server.port}", timeout_s=10) as client:
            reg = client.register_kv_cache(random_kv(8), FMT, namespace=NS)
            for i in range(20):
                tokens = list(range(1000 * i, 1000 * i + 8))
                assert client.store(reg, tokens, [0, 1, 2, 3]) == 8  # answered from a worker while the loop spins
                assert client.lookup(tokens, registration=reg).tokens == 8
                if i % 5 == 0:
                    time.sleep(0.03)  # past the spin: the loop sleeps in its poll again, and wakes for the next
    finally:
        started = time.monotonic()
        server.stop()
        assert time.monotonic() - started < 5


def test_the_server_also_listens_on_a_unix_socket(engine: FakeEngine, tmp_path: Any) -> None:
    from kvferry.config import ServerConfig

    path = tmp_path / "kvferry.sock"
    server = KvferryServer(ServerConfig(port=0, http_port=None, ipc_path=str(path)), engine)  # type: ignore[arg-type]
    server.start()
    try:
        assert server.ipc_endpoint == f"ipc://{path}" and path.is_socket()
        with KvferryClient(server.ipc_endpoint, timeout_s=10) as client:
            reg = client.register_kv_cache(random_kv(9), FMT, namespace=NS)
            assert client.store(reg, list(range(8)), [0, 1, 2, 3]) == 8
            assert client.lookup(list(range(8)), registration=reg).tokens == 8
            assert len(server.stats()["sessions"]) == 1
        wait_for(lambda: not server.stats()["sessions"], "the ipc session to end")
    finally:
        server.stop()
    assert not path.exists()  # the socket file goes with the server


def test_a_unix_socket_path_in_use_or_not_a_socket_is_refused(engine: FakeEngine, tmp_path: Any) -> None:
    from kvferry.config import ServerConfig
    from kvferry.server.server import ServerStartError

    path = tmp_path / "kvferry.sock"
    first = KvferryServer(ServerConfig(port=0, http_port=None, ipc_path=str(path)), engine)  # type: ignore[arg-type]
    first.start()
    try:
        second = KvferryServer(ServerConfig(port=0, http_port=None, ipc_path=str(path)), engine)  # type: ignore[arg-type]
        with pytest.raises(ServerStartError, match="another process"):
            second.start()
        second.stop()
        with KvferryClient(f"ipc://{path}", timeout_s=10) as client:  # the first server still has it
            assert client.ping()["chunk_size"] == engine.chunk_size
    finally:
        first.stop()
    precious = tmp_path / "notes.txt"
    precious.write_text("keep me")
    third = KvferryServer(ServerConfig(port=0, http_port=None, ipc_path=str(precious)), engine)  # type: ignore[arg-type]
    with pytest.raises(ServerStartError, match="not a socket"):
        third.start()
    third.stop()
    assert precious.read_text() == "keep me"

"""The Mooncake tier against a real `mooncake_master` on loopback: bit-exact round trips into the pool's memory,
two nodes' clients sharing objects, two writers of one key, a master killed and replaced, a full store."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from kvferry.cli.main import main
from kvferry.tiers import MooncakeTier, make_tier
from kvferry.tiers.base import resolved
from kvferry.tiers.header import encode_header, tensor_bytes
from kvferry.tiers.mooncake_tier import HEADER_BYTES
from tests.cli.benchkit import run_bench
from tests.tiers.mooncakekit import MooncakeStore, need_mooncake
from tests.tiers.tierkit import key, random_tensor, same_bits

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.float8_e4m3fn]


class SlabAlloc:
    """Carves tensors out of one slab registered with the tier, as the host pool does; counts frees."""

    def __init__(self, nbytes: int) -> None:
        self.slab = torch.empty(nbytes, dtype=torch.uint8)
        self._next = 0
        self.allocated = 0
        self.freed = 0

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if self._next + nbytes > self.slab.numel():
            return None
        start, self._next = self._next, self._next + -(-nbytes // 64) * 64
        self.allocated += 1
        return self.slab[start : start + nbytes].view(dtype).view(shape)

    def free(self, tensor: torch.Tensor) -> None:
        self.freed += 1

    def holds(self, tensor: torch.Tensor) -> bool:
        base = self.slab.data_ptr()
        return base <= tensor.data_ptr() < base + self.slab.numel()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeStore]:
    need_mooncake()
    running = MooncakeStore(tmp_path_factory.mktemp("mooncake")).start()
    yield running
    running.kill()


@pytest.fixture(scope="module")
def nodes(store: MooncakeStore) -> Iterator[list[MooncakeTier]]:
    """Two clients of the store, standing in for two nodes: 32 MiB of segment each (closing one takes ~2 s)."""
    made = [_tier(store.url(segment="32MiB", buffer="16MiB", name=f"node{i}")) for i in range(2)]
    yield made
    with ThreadPoolExecutor(2) as closing:
        list(closing.map(MooncakeTier.close, made))


def _tier(url: str, slab: SlabAlloc | None = None) -> MooncakeTier:
    tier = make_tier(url)
    assert isinstance(tier, MooncakeTier)
    if slab is not None:
        tier.use_memory(slab.slab)
    return tier


def test_round_trips_are_bit_exact_and_land_in_the_pool(nodes: list[MooncakeTier]) -> None:
    tier = nodes[0]
    slab = SlabAlloc(16 << 20)
    tier.use_memory(slab.slab)
    objects = {key(f"rt{i}"): random_tensor((3, 5, 257), dtype, seed=i) for i, dtype in enumerate(DTYPES)}
    objects[key("rt-big")] = random_tensor((4, 1 << 20), torch.bfloat16, seed=99)  # 8 MiB
    puts = [tier.put(k, obj) for k, obj in objects.items()]  # queued together: batched
    assert all(f.result(30) for f in puts)
    assert tier.contains_many([*objects, key("absent")]) == [True] * len(objects) + [False]
    gets = {k: tier.get(k, slab, slab.free) for k in objects}
    for k, future in gets.items():
        got = future.result(30)
        assert same_bits(got, objects[k]) and got is not None and slab.holds(got)
    misses = tier.stats()["ops"]["get"].get("miss", 0)
    assert tier.get(key("absent"), slab, slab.free).result(30) is None
    assert tier.stats()["ops"]["get"]["miss"] == misses + 1 and tier.healthy
    tier.delete(key("rt0"))
    assert not tier.contains(key("rt0")) and tier.get(key("rt0"), slab, slab.free).result(30) is None


def test_two_nodes_share_objects_and_two_writers_of_a_key_both_succeed(nodes: list[MooncakeTier]) -> None:
    obj = random_tensor((2, 1 << 19), torch.float16, seed=7)
    start = threading.Barrier(2)
    results: list[bool] = []

    def write(tier: MooncakeTier) -> None:
        start.wait()
        results.append(tier.put(key("both"), obj).result(30))

    writers = [threading.Thread(target=write, args=(tier,)) for tier in nodes]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(30)
    assert results == [True, True]
    mine = random_tensor((1000,), torch.int32, seed=8)
    assert nodes[0].put(key("from-a"), mine).result(30)
    slab = SlabAlloc(8 << 20)
    for tier in nodes:  # each node reads what either wrote, whichever segment holds it
        assert same_bits(tier.get(key("both"), slab, slab.free).result(30), obj)
        assert same_bits(tier.get(key("from-a"), slab, slab.free).result(30), mine)


@pytest.mark.parametrize(
    ("name", "payload_checksum", "damaged_byte"),
    [("header", False, 40), ("payload", True, HEADER_BYTES + 200)],  # byte 40: the shape; past the header: payload
)
def test_an_object_damaged_in_the_store_is_a_miss_and_removed(
    nodes: list[MooncakeTier], name: str, payload_checksum: bool, damaged_byte: int
) -> None:
    """A reader checks whatever checksum an object carries: one written with ``checksum=payload`` (here by hand,
    as another node's tier writes it) is checked to its last byte by a tier set to ``header``."""
    writer, reader = nodes
    k, good = key(f"damaged-{name}"), random_tensor((4096,), torch.uint8, seed=3)
    header = encode_header(k, good, tensor_bytes(good), align=HEADER_BYTES, payload_checksum=payload_checksum)
    stored = bytearray(header + bytes(good.numpy()))
    stored[damaged_byte] ^= 0x10
    assert writer.store().put(k.hex(), bytes(stored)) == 0  # the tier's own client, used as any Mooncake user could
    slab = SlabAlloc(1 << 20)
    corrupt = reader.stats()["ops"].get("get", {}).get("corrupt", 0)
    assert reader.get(k, slab, slab.free).result(30) is None
    assert reader.stats()["ops"]["get"]["corrupt"] == corrupt + 1 and slab.freed == slab.allocated
    assert not reader.contains(k)


def test_reads_of_the_usual_shape_take_one_call_and_other_shapes_are_read_after_their_header(
    nodes: list[MooncakeTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = nodes[0]
    slab = SlabAlloc(16 << 20)
    tier.use_memory(slab.slab)
    usual = {key(f"usual{i}"): random_tensor((4, 3, 1001), torch.bfloat16, seed=i) for i in range(6)}
    others = {
        key("same-bytes"): random_tensor((3, 4, 1001), torch.float16, seed=20),  # as many bytes, another shape
        key("smaller"): random_tensor((7, 9), torch.float32, seed=21),
        key("larger"): random_tensor((5, 3, 1001), torch.bfloat16, seed=22),
    }
    # the usual shape is the last one stored: the others first, then the usual ones (puts of one call may end in
    # any order across the tier's workers)
    assert all(f.result(30) for f in [tier.put(k, o) for k, o in others.items()])
    assert all(f.result(30) for f in [tier.put(k, o) for k, o in usual.items()])
    calls: list[str] = []
    store = tier.store()

    class Counting:  # the client as the tier's reads see it, counting its calls
        def __getattr__(self, name: str) -> Any:
            calls.append(name)
            return getattr(store, name)

    monkeypatch.setattr(tier._reads, "_client", type("C", (), {"client": lambda _: Counting(),
                                                                "headers": tier._client.headers})())  # fmt: skip
    for k, obj in usual.items():
        assert same_bits(tier.get(k, slab, slab.free).result(30), obj)
    assert calls == ["batch_get_replica_desc", "batch_get_into_multi_buffers"] * len(usual)  # no header read
    calls.clear()
    for k, obj in others.items():
        assert same_bits(tier.get(k, slab, slab.free).result(30), obj)
    assert calls.count("get_into_ranges") == len(others)  # each read after its header
    assert slab.freed == 1  # the tensor of the usual shape given to "same-bytes" went back
    calls.clear()
    no_free = tier.get(key("usual0"), slab).result(30)  # without a free: straight to the header read
    assert same_bits(no_free, usual[key("usual0")])
    assert calls == ["batch_get_replica_desc", "get_into_ranges", "batch_get_into_multi_buffers"]


def test_a_full_store_refuses_puts_but_stays_healthy(nodes: list[MooncakeTier]) -> None:
    tier = nodes[1]
    too_big = random_tensor((80 << 20,), torch.uint8, seed=5)  # more than both nodes' segments together
    assert tier.put(key("huge"), too_big).result(30) is False
    assert tier.healthy and tier.stats()["ops"]["put"]["full"] == 1
    small = random_tensor((1000,), torch.uint8, seed=6)
    assert tier.put(key("small"), small).result(30)


# A node of its own: a raw client that stores one object in its segment, says so, and waits to be killed.
_SEGMENT_NODE = """
import sys, time
from mooncake.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
config = dict(local_hostname="127.0.0.1", metadata_server=sys.argv[1], global_segment_size=16 << 20,
              local_buffer_size=16 << 20, protocol="tcp", rdma_devices="", master_server_addr=sys.argv[2])
assert store.setup(config) == 0
assert store.put(sys.argv[3], bytes(range(256)) * 64) == 0
print("stored", flush=True)
time.sleep(600)
"""


def test_a_dead_segment_a_frozen_and_a_killed_master_are_misses_then_the_tier_recovers(tmp_path: Path) -> None:
    need_mooncake()
    own = MooncakeStore(tmp_path).start()
    metadata = f"http://127.0.0.1:{own.metadata_port}/metadata"
    node = subprocess.Popen(
        [sys.executable, "-c", _SEGMENT_NODE, metadata, f"127.0.0.1:{own.rpc_port}", key("orphan").hex()],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    tier = _tier(own.url(segment="16MiB", backoff="200ms", backoff_max="200ms", timeout="1s"))
    slab = SlabAlloc(1 << 20)
    try:
        assert node.stdout is not None and node.stdout.readline().strip() == "stored"
        node.kill()  # the only segment holding "orphan" is gone; the master still lists it
        node.wait(10)
        assert tier.get(key("orphan"), slab, slab.free).result(30) is None
        assert tier.healthy and tier.stats()["ops"]["get"] == {"error": 1}  # one object lost, not the tier
        assert not tier.contains(key("orphan"))  # dropped, so nobody tries it again

        obj = random_tensor((2048,), torch.bfloat16, seed=11)
        deadline = time.monotonic() + 30
        while not tier.put(key("lost"), obj).result(30):  # placed in the dead segment until the master drops it
            assert time.monotonic() < deadline, "the master did not drop the dead node's segment"
            assert tier.stats()["ops"]["put"].keys() <= {"error", "unavailable"}
            # The client's retries towards the dead node may outlast `timeout` on a loaded machine: the put is
            # then a timeout, the tier unhealthy until its probe finds the master again.
            _wait_healthy(tier)
            time.sleep(0.1)
        own.freeze_master()
        started = time.monotonic()
        # A key never stored: only the master can answer for it (the client may know where a stored one lies)
        assert tier.get(key("never stored"), slab, slab.free).result(30) is None  # timeout=1s, then a miss
        assert time.monotonic() - started < 3 and not tier.healthy
        assert tier.stats()["ops"]["get"]["unavailable"] == 1
        own.thaw_master()
        _wait_healthy(tier)
        assert same_bits(tier.get(key("lost"), slab, slab.free).result(30), obj)

        own.kill_master()
        started = time.monotonic()
        assert tier.get(key("lost"), slab, slab.free).result(30) is None
        assert time.monotonic() - started < 3  # the deadline, whatever the client does
        assert not tier.healthy and tier.stats()["ops"]["get"]["unavailable"] == 2
        started = time.monotonic()
        assert tier.contains_many([key("lost")]) == [False]  # skipped while unhealthy: no wait
        assert tier.put(key("skipped"), obj).result(30) is False
        assert time.monotonic() - started < 0.5
        own.start_master()
        deadline = _wait_healthy(tier)
        assert not tier.contains(key("lost"))  # the master's index lived in memory
        # Puts are refused as full until the client's heartbeat mounts its segment on the new master.
        while not tier.put(key("after"), obj).result(30):
            assert time.monotonic() < deadline and tier.healthy, "the segment was not mounted on the new master"
            time.sleep(0.1)
        assert same_bits(tier.get(key("after"), slab, slab.free).result(30), obj)
    finally:
        node.kill()
        tier.close()
        own.kill()


def _wait_healthy(tier: MooncakeTier) -> float:
    deadline = time.monotonic() + 20
    while not tier.check():
        assert time.monotonic() < deadline, "the tier did not come back"
        time.sleep(0.1)
    return deadline


def test_bench_tiers_puts_the_tier_beside_the_raw_client(
    store: MooncakeStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    args = ("--total-mib", "4", "--reps", "1", "--objects", "qwen2.5-0.5b", "--dir", str(tmp_path))
    doc, progress = run_bench(monkeypatch, tmp_path, "tiers", *args, "--mooncake", store.url(segment="32MiB"))
    rows = [r for r in doc["results"]["rows"] if r["tier"] == "mooncake"]
    assert [r["op"] for r in rows] == ["write", "read"] and "qwen2.5-0.5b: mooncake pass 1/1" in progress.done
    assert all(r["tier_GBps"] > 0 and r["plain_1_thread_GBps"] > 0 for r in rows)
    assert doc["config"]["mooncake"] == store.url(segment="32MiB")


@pytest.mark.parametrize("wrong", ["tier read", "raw read"])
def test_bench_tiers_fails_on_a_wrong_transfer(
    store: MooncakeStore,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    wrong: str,
) -> None:
    """A tier read that flips a bit, or a raw read that reports its bytes without moving them, fails the bench."""
    if wrong == "tier read":
        get = MooncakeTier.get

        def flipped(self: MooncakeTier, *args: Any, **kwargs: Any) -> Any:
            got = get(self, *args, **kwargs).result()
            if got is not None:
                got.view(-1).view(torch.uint8)[7] ^= 1
            return resolved(got)

        monkeypatch.setattr(MooncakeTier, "get", flipped)
    else:
        real = MooncakeTier.store

        class NoRead:  # the client, but its batch_get_into claims the bytes and moves none
            def __init__(self, store: Any) -> None:
                self._store = store

            def __getattr__(self, name: str) -> Any:
                return getattr(self._store, name)

            def batch_get_into(self, keys: list[str], pointers: list[int], sizes: list[int]) -> list[int]:
                return list(sizes)

        monkeypatch.setattr(MooncakeTier, "store", lambda self: NoRead(real(self)))
    args = (
        "--total-mib",
        "4",
        "--reps",
        "2",
        "--objects",
        "qwen2.5-0.5b",
        "--dir",
        str(tmp_path),
        "--json",
        str(tmp_path / "out.json"),
    )
    assert main(["bench", "tiers", *args, "--mooncake", store.url(segment="32MiB")]) == 1
    said = {"tier read": "the Mooncake tier returned wrong bytes", "raw read": "the raw Mooncake client failed"}
    assert said[wrong] in capsys.readouterr().err


def test_urls_name_the_master_and_refuse_what_they_do_not_know() -> None:
    from kvferry.tiers import TierURLError, parse_tier_url

    spec = parse_tier_url("mooncake://10.0.0.1?metadata=http://10.0.0.1:8080/metadata&segment=2GiB&protocol=rdma")
    assert spec.args == (("10.0.0.1", 50051), "http://10.0.0.1:8080/metadata")
    assert spec.kwargs["segment_bytes"] == 2 << 30 and spec.kwargs["protocol"] == "rdma"
    for url, message in [
        ("mooncake://h:1", "needs metadata="),
        ("mooncake://h:1?metadata=http://h:2/metadata&colour=red", "unknown parameter 'colour'"),
        ("mooncake://h:1?metadata=http://h:2/metadata&protocol=udp", "protocol='udp' must be tcp or rdma"),
        ("mooncake://h:1?metadata=http://h:2/metadata&segment=lots", "size 'lots'"),
        ("mooncake://h:1/x?metadata=http://h:2/metadata", "expected mooncake://host:rpc_port"),
    ]:
        with pytest.raises(TierURLError, match=message):
            parse_tier_url(url)

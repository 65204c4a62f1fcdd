"""The linker's loads in groups of layers (``"layer_groups"``), driven by SGLang's own classes as in
`sglang_linker_checks`: each group of the forward's layers is handed to SGLang's layer counter as it lands, so the
forward reads the first layers while the last are still moving; each group's pages are objects of their own, and a
page is a hit only where every group holds it. The linker's counter answers SGLang's calls on the CPU as SGLang's own
counter does.

Run by `test_sglang_release` in a child pytest with a released SGLang's Python first on the path.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from tests.integrations import sglang_standin

sglang_standin.install()

from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import LayerWiseLoadCounter  # noqa: E402

from kvferry.integrations.sglang.load_counter import LoadCounter  # noqa: E402
from tests.integrations.sglang_linker_checks import (  # noqa: E402
    EMBEDDED,
    LAYERS,
    PAGE,
    Device,
    check_round_trip,
    lookup,
    make_linker,
    offload,
    page_keys,
)
from tests.integrations.sglangkit import page_server, url_of  # noqa: E402

GROUPED = {"layer_groups": LAYERS}  # a layer a group


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    with page_server(PAGE) as server:
        yield url_of(server)


def _settings(mode: str, server_url: str) -> dict[str, Any]:
    return {**(EMBEDDED if mode == "embedded" else {"mode": "server", "server_url": server_url}), **GROUPED}


def _later(move: Callable[..., Future[int]], gate: threading.Event) -> Callable[..., Future[int]]:
    """``move``, started only once ``gate`` opens (the caller is not held: a future comes back at once)."""

    def started(*args: Any) -> Future[int]:
        out: Future[int] = Future()

        def run() -> None:
            gate.wait(10)
            try:
                out.set_result(move(*args).result())
            except BaseException as exc:
                out.set_exception(exc)

        threading.Thread(target=run, daemon=True).start()
        return out

    return started


def _load_held(
    device: Device, linker: Any, keys: list[str], held: int
) -> tuple[int, torch.Tensor, torch.Tensor, threading.Event]:
    """``keys``' pages offloaded, then loaded into other slots (poisoned first) with group ``held``'s copy started
    only once the returned gate opens; the batch's counter index, the slots, the bytes they must hold, the gate."""
    source = device.alloc(len(keys))
    expected = device.read(source)
    assert offload(linker, keys, source)
    backend = linker.store.pools["kv"].backends[held]
    gate = threading.Event()
    backend.retrieve_pages_async = _later(backend.retrieve_pages_async, gate)
    assert lookup(linker, keys) == list(range(1, len(keys) + 1))
    device.poison()
    target = device.alloc(len(keys))
    assert linker.load("r", [PoolTransfer(name=PoolName.KV, device_indices=target, keys=keys)])
    index = linker.start_layer_wise_loading()
    linker.layer_done_counter.set_consumer(index)
    return index, target, expected, gate


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("mode", ["embedded", "server"])
def test_grouped_pages_round_trip_bit_exact(kind: str, mode: str, server_url: str) -> None:
    """Stored and loaded in groups of layers, in process or through a server: the round trip of
    `sglang_linker_checks` (bit-exact into other slots, nothing else written, misses, a failed load)."""
    writer_device, reader_device = Device(kind, seed=90), Device(kind, seed=91)
    settings = _settings(mode, server_url)
    writer = make_linker(writer_device, settings)
    reader = writer if mode == "embedded" else make_linker(reader_device, settings)
    try:
        assert [len(pool.backends) for pool in writer.store.pools.values()] == [LAYERS]
        check_round_trip(writer_device, writer, writer_device if mode == "embedded" else reader_device, reader, 92)
    finally:
        writer.close()
        reader.close()


@pytest.mark.parametrize("mode", ["embedded", "server"])
def test_the_forward_reads_the_first_layers_before_the_last_group_lands(mode: str, server_url: str) -> None:
    """The last group's copy held back: the forward's wait for layer 0 returns (the counter has it) while the
    last layer's does not; once it lands, the batch finishes whole and bit-exact. A group that fails after the
    first landed fails the batch (SGLang aborts its requests)."""
    device = Device("mha", seed=93)
    linker = make_linker(device, _settings(mode, server_url))
    try:
        keys = page_keys(3, 94)
        index, target, expected, gate = _load_held(device, linker, keys, held=LAYERS - 1)
        counter = linker.layer_done_counter
        device.pool.get_key_buffer(0)  # SGLang's forward, layer 0: waits for the counter
        assert counter.landed(index, 0) and not counter.landed(index, LAYERS - 1)
        gate.set()
        for layer in range(LAYERS):
            device.pool.get_key_buffer(layer)
        assert linker.finish_layer_wise_loading(index)
        assert torch.equal(device.read(target), expected)

        failing = linker.store.pools["kv"].backends[1]
        failing.retrieve_pages_async = lambda *args: _failed(RuntimeError("a copy that did not land"))
        assert lookup(linker, keys, rid="s") == [1, 2, 3]
        assert linker.load("s", [PoolTransfer(name=PoolName.KV, device_indices=target, keys=keys)])
        index = linker.start_layer_wise_loading()
        counter.set_consumer(index)
        for layer in range(LAYERS):
            device.pool.get_key_buffer(layer)
        assert counter.landed(index, 0)  # layer 0 had landed
        assert not linker.finish_layer_wise_loading(index)
    finally:
        linker.close()


def test_groups_that_land_before_the_first_complete_after_it() -> None:
    """The first group's copy held back while the later ones land: no layer completes until it does (a forward
    reading a later layer must not run before the layers before it), then every one, and the batch lands whole."""
    device = Device("mha", seed=101)
    linker = make_linker(device, _settings("embedded", ""))
    try:
        index, target, expected, gate = _load_held(device, linker, page_keys(2, 102), held=0)
        time.sleep(0.2)  # the later groups' moves land meanwhile
        assert not any(linker.layer_done_counter.landed(index, layer) for layer in range(LAYERS))
        gate.set()
        for layer in range(LAYERS):
            device.pool.get_key_buffer(layer)
        assert linker.finish_layer_wise_loading(index)
        assert torch.equal(device.read(target), expected)
    finally:
        linker.close()


def test_a_page_one_group_lacks_is_a_miss_and_groups_are_keyed_apart(server_url: str) -> None:
    """Through one server: a page whose middle group was never stored is no hit; pages stored in groups are no hits
    for a linker that loads whole objects (other objects, other keys), nor the other way round."""
    device = Device("mha", seed=95)
    grouped = make_linker(device, _settings("server", server_url))
    whole = make_linker(Device("mha", seed=96), {"mode": "server", "server_url": server_url})
    try:
        keys = page_keys(2, 97)
        middle = grouped.store.pools["kv"].backends[1]
        stored = middle.store_pages_async
        middle.store_pages_async = lambda tokens, blocks: _done(len(tokens))  # reports a store it never made
        assert offload(grouped, keys, device.alloc(2))
        assert lookup(grouped, keys) == []
        middle.store_pages_async = stored
        assert offload(grouped, keys, device.alloc(2))
        assert lookup(grouped, keys) == [1, 2]
        assert lookup(whole, keys) == []
        others = page_keys(2, 98)
        assert offload(whole, others, device.alloc(2))
        assert lookup(whole, others) == [1, 2] and lookup(grouped, others) == []
    finally:
        grouped.close()
        whole.close()


def _done(tokens: int) -> Future[int]:
    future: Future[int] = Future()
    future.set_result(tokens)
    return future


def _failed(error: BaseException) -> Future[int]:
    future: Future[int] = Future()
    future.set_exception(error)
    return future


@pytest.mark.parametrize("counter_class", [LayerWiseLoadCounter, LoadCounter])
def test_the_linkers_counter_answers_on_the_cpu_as_sglangs_does(counter_class: type) -> None:
    """The calls SGLang makes of a linker's counter, on a load waited for on the CPU (through a server, into CPU
    tensors), answered by kvferry's counter as by SGLang's own: a forward's wait blocks until the layer is
    completed and never raises, `finish` says whether every layer landed and forgets the batch, `reset` starts
    the indices over."""
    counter = counter_class(LAYERS)
    index = counter.update_producer()
    counter.set_consumer(index)
    completing = threading.Event()  # set just before the layer is completed: a wait cannot return before it

    def land() -> None:
        completing.set()
        counter.complete(index, 0)

    threading.Timer(0.05, land).start()
    counter.wait_until(0)
    assert completing.is_set() and counter.consumer_index == index and counter.num_layers == LAYERS
    counter.fail(index, RuntimeError("a copy that did not land"))
    counter.wait_until(LAYERS - 1)  # a failed layer: the forward goes on
    assert counter.finish(index) is False and counter.finish(index) is True
    counter.reset()
    assert counter.update_producer() == 0 and counter.consumer_index == -1

"""The SGLang linker's token rows (`page_tokens`: a page's key as the tokens it is stored under): a load takes those
its request's lookup made for the same pages (the conversion is on a load's path to its first DMA), and converts its
own where its pages are not the lookup's first ones; an offload through a server sends its pages' keys and makes no
rows at all. Loads checked bit-exact, on CPU tensors."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvferry.bench.sglang_linker_path import LinkerPath
from kvferry.bench.sglang_pools import load_fixtures
from kvferry.connector.settings import ConnectorSettings
from kvferry.integrations.sglang import linker_store, page_store
from kvferry.integrations.sglang.device_pools import KV
from kvferry.integrations.sglang.linker_pools import PoolPages
from kvferry.integrations.sglang.page_store import KEY_TOKENS
from kvferry.protocol import messages
from tests.integrations.sglangkit import page_server, url_of

PAGES = 3


FIXTURE = next(f for f in load_fixtures() if f["case"]["page_size"] >= KEY_TOKENS and f["case"]["kind"] == "mha")


@pytest.fixture
def path() -> Iterator[LinkerPath]:
    page = FIXTURE["case"]["page_size"]
    settings = ConnectorSettings(mode="embedded", config={"cache": {"chunk_size": page, "l1_size_gb": 0.02}})
    linker_path = LinkerPath(FIXTURE, settings, "cpu", PAGES)
    linker_path.next_round()
    linker_path.store()
    yield linker_path
    linker_path.close()


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The page count of each `page_tokens` call the linker's store makes."""
    calls: list[int] = []
    convert = linker_store.page_tokens

    def counted(keys: Any, page_size: int) -> Any:
        calls.append(len(keys))
        return convert(keys, page_size)

    monkeypatch.setattr(linker_store, "page_tokens", counted)  # the lookup's
    monkeypatch.setattr(page_store, "page_tokens", counted)  # `PageTokens`' (the store's, and a load's own)
    return calls


def _load(path: LinkerPath, keys: list[str], blocks: list[int]) -> None:
    """Load ``keys`` into ``blocks`` as the scheduler and the forward do; `path.check_load` then checks it."""
    assert path.store_.queue_load("bench", [PoolPages(KV, keys, blocks)])  # the rid `before_load` looked up
    path._index = path.store_.start_loads()
    path.counter.set_consumer(path._index)
    path.counter.wait_until(path.counter.num_layers - 1)


def _holds(path: LinkerPath, pages: slice) -> bool:
    """Whether the destination pages ``pages`` of the prefix hold their source pages' bytes in every buffer, once
    the last load has landed."""
    assert path.counter.finish(path._index)
    src, dst = path._rows(path.src[pages]), path._rows(path.dst[pages])
    raw = [buffer.view(torch.uint8) for buffer in path.buffers]  # bytes: random bf16 bytes hold NaNs
    return all(torch.equal(buffer[dst], buffer[src]) for buffer in raw)


def test_a_load_takes_its_lookup_s_rows(path: LinkerPath, conversions: list[int]) -> None:
    path.before_load()  # the lookup of every page
    assert conversions == [PAGES]
    _load(path, path.keys, path.dst)
    assert conversions == [PAGES]  # none at the load
    path.check_load()


def test_a_load_of_the_lookup_s_first_pages_takes_their_rows(path: LinkerPath, conversions: list[int]) -> None:
    path.before_load()
    _load(path, path.keys[:2], path.dst[:2])
    assert conversions == [PAGES]
    assert _holds(path, slice(0, 2)) and not _holds(path, slice(2, 3))  # the last page holds the poison still


def test_a_load_of_pages_the_lookup_did_not_lead_with_converts_its_own(
    path: LinkerPath, conversions: list[int]
) -> None:
    path.before_load()
    _load(path, path.keys[1:], path.dst[1:])  # not the lookup's first pages
    assert conversions == [PAGES, PAGES - 1]
    assert _holds(path, slice(1, 3)) and not _holds(path, slice(0, 1))


def test_an_offload_through_a_server_sends_its_pages_keys_not_their_tokens(
    conversions: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a server the offload's STORE carries its pages' 32-byte keys and no tokens: the engine's side makes
    no token rows for it (the server makes them from the keys, after the copy is enqueued), and a load of the pages,
    looked up by their tokens as ever, finds them and is bit-exact."""
    sent: list[dict[str, Any]] = []
    encode = messages.encode_request

    def recorded(op: Any, request_id: int, args: dict[str, Any], *rest: Any) -> bytes:
        sent.append({"op": op.value, **args})
        return encode(op, request_id, args, *rest)

    monkeypatch.setattr("kvferry.client.connection.encode_request", recorded)
    with page_server(FIXTURE["case"]["page_size"]) as server:
        settings = ConnectorSettings.from_extra_config({"mode": "server", "server_url": url_of(server)})
        path = LinkerPath(FIXTURE, settings, "cpu", PAGES)
        try:
            path.next_round()
            path.store()
            stores = [args for args in sent if args["op"] == "STORE"]
            assert conversions == [] and len(stores) == 1
            assert stores[0]["tokens"] == b"" and len(stores[0]["page_keys"]) == 32 * PAGES
            path.before_load()  # the lookup, by the pages' tokens
            path.load()
            path.check_load()
            path.before_load()
            _load(path, path.keys[1:], path.dst[1:])  # not the lookup's first pages: their keys go, not rows
            retrieves = [args for args in sent if args["op"] == "RETRIEVE"]
            assert len(retrieves[-1]["page_keys"]) == 32 * (PAGES - 1) and retrieves[-1]["tokens"] == b""
            assert _holds(path, slice(1, 3)) and not _holds(path, slice(0, 1))
        finally:
            path.close()

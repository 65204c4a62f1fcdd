"""Pages looked up together (`ServerBackend.lookup_each`, `page_store.leading_pages`): SGLang's two ways in look up
a request's pages in one call, and a server's lookups (and the frees of their locks) go out together. A scripted
link and client (no server)."""

from __future__ import annotations

import hashlib
from concurrent.futures import Future
from typing import Any

import numpy as np

from kvferry.client.errors import ServerError
from kvferry.client.records import LookupResult
from kvferry.connector.backends import Hit, KeySpace
from kvferry.connector.server_backend import ServerBackend
from kvferry.integrations.sglang.page_store import leading_pages, page_tokens

PAGE = 16
KEY_SPACE = KeySpace("m", "", "NL_X_TWO_NB_BS_NH_HS", "bfloat16", 2, 1, 8)


class ScriptedClient:
    """Answers each LOOKUP from ``answers`` in order (a LookupResult, or an exception to fail its future); records
    what was sent before the first answer was asked for, and the locks freed."""

    def __init__(self, answers: list[LookupResult | Exception]) -> None:
        self.answers = answers
        self.sent: list[Any] = []
        self.futures: list[Future[LookupResult]] = []
        self.freed: list[int] = []
        self.frees: list[Future[bool]] = []
        self.freed_together: list[list[int]] = []
        self.frees_together: list[Future[int]] = []
        self.refuses_many = False
        self.sent_each: list[list[Any]] = []
        self.each: list[Future[list[LookupResult]]] = []
        self.refuses_each = False
        self.calls = 0

    def lookup_async(self, tokens: Any, **kwargs: Any) -> Future[LookupResult]:
        future: Future[LookupResult] = Future()
        self.sent.append(tokens)
        self.futures.append(future)
        return future

    def lookup_each_async(self, prompts: Any, **kwargs: Any) -> Future[list[LookupResult]]:
        """Answered once sent (`ScriptedLink`): every answer (all LookupResults), or refused as a server that predates
        LOOKUP_EACH refuses it."""
        self.sent_each.append(list(prompts))
        future: Future[list[LookupResult]] = Future()
        self.each.append(future)
        return future

    def answer(self) -> None:
        for future, answer in zip(self.futures, self.answers, strict=True):
            if isinstance(answer, Exception):
                future.set_exception(answer)
            else:
                future.set_result(answer)

    def free_lookup_locks_async(self, lock: int) -> Future[bool]:
        self.freed.append(lock)
        future: Future[bool] = Future()
        self.frees.append(future)
        return future

    def free_lookup_locks_many_async(self, locks: list[int]) -> Future[int]:
        """Freed, or refused as a server that predates ``locks`` refuses the argument (once sent: `ScriptedLink`)."""
        self.freed_together.append(locks)
        future: Future[int] = Future()
        self.frees_together.append(future)
        return future


class ScriptedLink:
    generation, timeout_s, url, chunk_size = 3, 5.0, "tcp://127.0.0.1:1", PAGE

    def __init__(self, client: ScriptedClient) -> None:
        self.client = client

    def wait(self, fn: Any, timeout_s: float | None) -> Any:
        return self.call(fn).result(timeout=timeout_s)

    def call(self, fn: Any) -> Any:
        self.client.calls += 1
        result = fn(self.client, None)
        if self.client.each:
            for future in self.client.each:
                if self.client.refuses_each:
                    future.set_exception(ServerError("LOOKUP_EACH", "UNKNOWN_OP", "unknown op 'LOOKUP_EACH'"))
                else:
                    future.set_result(self.client.answers)  # type: ignore[arg-type]  # LookupResults only
            self.client.each = []
        elif self.client.frees_together:
            for future in self.client.frees_together:
                if self.client.refuses_many:
                    error = ServerError("FREE_LOOKUP_LOCKS", "BAD_ARGUMENT", "'locks': unexpected argument")
                    future.set_exception(error)
                else:
                    future.set_result(len(self.client.freed_together[-1]))
            self.client.frees_together = []
        elif self.client.frees:  # the frees are all sent before any reply is awaited
            assert result == self.client.frees and not any(f.done() for f in result)
            for future in self.client.frees:
                future.set_result(True)
            self.client.frees = []
        elif isinstance(result, list):  # so are the lookups
            assert len(self.client.sent) == len(self.client.answers) and not any(f.done() for f in result)
            self.client.answer()
        return result


def test_a_servers_lookups_go_in_one_request() -> None:
    client = ScriptedClient([LookupResult(PAGE, 0, 11), LookupResult(0, PAGE, 12), LookupResult(0, 0, None)])
    backend = ServerBackend(ScriptedLink(client), KEY_SPACE, block_size=PAGE)  # type: ignore[arg-type]
    prompts = list(page_tokens([f"{i:064x}" for i in range(3)], PAGE))
    # a hit keeps its lock (tagged with the link's generation); chunks still coming up: None, its lock freed
    assert backend.lookup_each(prompts) == [Hit(PAGE, (3, 11)), None, Hit(0, None)]
    assert client.sent_each == [prompts] and client.sent == [] and client.freed == [12]


def test_an_older_servers_lookups_go_out_together_and_each_stands_alone() -> None:
    client = ScriptedClient(
        [LookupResult(PAGE, 0, 11), LookupResult(0, PAGE, 12), ConnectionError("lost"), LookupResult(0, 0, None)]
    )
    client.refuses_each = True  # a server that predates LOOKUP_EACH
    backend = ServerBackend(ScriptedLink(client), KEY_SPACE, block_size=PAGE)  # type: ignore[arg-type]
    prompts = list(page_tokens([f"{i:064x}" for i in range(4)], PAGE))
    hits = backend.lookup_each(prompts)
    assert client.sent == prompts and len(client.sent_each) == 1
    # a hit keeps its lock (tagged with the link's generation); chunks still coming up: None, its lock freed;
    # a failed lookup: a miss
    assert hits == [Hit(PAGE, (3, 11)), None, Hit(0), Hit(0, None)]
    assert client.freed == [12]
    client.sent, client.futures = [], []
    assert backend.lookup_each(prompts) == hits and len(client.sent_each) == 1  # not asked again


def test_a_servers_locks_are_freed_in_one_request() -> None:
    client = ScriptedClient([])
    backend = ServerBackend(ScriptedLink(client), KEY_SPACE, block_size=PAGE)  # type: ignore[arg-type]
    backend.free_locks([(3, 21), None, (2, 22), (3, 23)])  # a lock of a server since gone went with it
    assert client.freed_together == [[21, 23]] and client.freed == [] and client.calls == 1
    backend.free_locks([None, (1, 24)])
    assert client.calls == 1  # nothing to send
    backend.free_locks([(3, 25)])
    assert client.freed == [25] and client.freed_together == [[21, 23]]


def test_a_server_that_predates_freeing_many_gets_a_request_a_lock_sent_together() -> None:
    client = ScriptedClient([])
    client.refuses_many = True
    backend = ServerBackend(ScriptedLink(client), KEY_SPACE, block_size=PAGE)  # type: ignore[arg-type]
    backend.free_locks([(3, 21), (3, 23)])
    assert client.freed_together == [[21, 23]] and client.freed == [21, 23]
    backend.free_locks([(3, 26), (3, 27)])  # not asked again
    assert client.freed_together == [[21, 23]] and client.freed == [21, 23, 26, 27]


class ScriptedPages:
    """A page backend answering `lookup_each` from ``hits``, recording the locks freed."""

    def __init__(self, hits: list[Hit | None]) -> None:
        self.hits = hits
        self.freed: list[Any] = []

    def lookup_each(self, prompts: list[Any]) -> list[Hit | None]:
        assert len(prompts) == len(self.hits)
        return self.hits

    def free_locks(self, locks: list[Any]) -> None:
        self.freed += locks


def test_the_leading_pages_keep_their_locks_and_those_after_a_miss_are_freed() -> None:
    pages = ScriptedPages([Hit(PAGE, "a"), Hit(PAGE, "b"), Hit(PAGE // 2, "c"), Hit(PAGE, "d"), None])
    assert leading_pages(pages, ["k"] * 5, PAGE) == (2, ["a", "b"])  # type: ignore[arg-type]
    assert pages.freed == ["c", "d"]
    pages = ScriptedPages([Hit(PAGE, "a"), Hit(PAGE, None)])
    assert leading_pages(pages, ["k"] * 2, PAGE) == (2, ["a"])  # type: ignore[arg-type]
    assert leading_pages(ScriptedPages([]), [], PAGE) == (0, [])  # type: ignore[arg-type]


def test_a_page_hash_is_stored_under_its_own_digits_and_any_other_key_under_its_sha256() -> None:
    page_hash = hashlib.sha256(b"page 0").hexdigest()
    other = ["not a page hash", "ab " * 21 + "a", page_hash.upper()[:63] + "g"]  # 64 characters, not 32 bytes
    rows = page_tokens([page_hash, *other], PAGE)
    words = np.frombuffer(bytes.fromhex(page_hash), dtype="<u4") & 0x7FFFFFFF
    assert rows.shape == (4, PAGE) and rows.dtype == np.dtype("<u4")
    assert rows[0, :8].tolist() == words.tolist()
    for row, key in zip(rows[1:], other, strict=True):
        assert row[:8].tolist() == (np.frombuffer(hashlib.sha256(key.encode()).digest(), "<u4") & 0x7FFFFFFF).tolist()
    assert not rows[:, 8:].any()


def test_a_key_s_tokens_do_not_depend_on_the_keys_beside_it() -> None:
    hashes = [hashlib.sha256(bytes([i])).hexdigest() for i in range(5)]
    alone = [page_tokens([key], PAGE)[0].tolist() for key in [*hashes, "x"]]
    assert page_tokens(hashes, PAGE).tolist() == alone[:5]  # all page hashes: decoded together
    assert page_tokens([*hashes, "x"], PAGE).tolist() == alone  # one that is not: each on its own
    assert len({tuple(row) for row in alone}) == 6

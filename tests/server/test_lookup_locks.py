"""Lookup locks through the server: whose they are, how they end, and that a failed lookup keeps none."""

from __future__ import annotations

from typing import Any

import pytest

from kvferry.client import KvferryClient, ServerError
from kvferry.protocol.messages import Op
from tests.server.conftest import TCP_AND_IPC
from tests.server.serverkit import FakeEngine, random_kv, raw_request

pytestmark = TCP_AND_IPC

FMT = 3  # NL_X_NB_BS_HS: one layer of [NB, BS, W] is what the fake engine copies
NS = {"model": "fake-model"}


def test_lookup_locks_are_freed_many_in_one_request_and_only_the_sessions_own(
    endpoint: str, engine: FakeEngine
) -> None:
    """FREE_LOOKUP_LOCKS with ``locks`` (an SGLang lookup holds one a page): the session's held ones freed and
    counted; another session's lock, one already ended and an unknown id are left alone; one of ``lock`` and
    ``locks``, not both or neither."""
    tokens = list(range(200, 208))
    with KvferryClient(endpoint) as owner, KvferryClient(endpoint) as other:
        reg = owner.register_kv_cache(random_kv(4), FMT, namespace=NS)
        owner.store(reg, tokens, [0, 1, 2, 3])
        held = [owner.lookup(tokens, registration=reg, lock=True).lock for _ in range(4)]
        theirs = other.lookup(
            tokens, registration=other.register_kv_cache(random_kv(5), FMT, namespace=NS), lock=True
        ).lock
        assert owner.free_lookup_locks(held[3])
        assert owner.free_lookup_locks_many_async([*held, theirs, 999_999]).result(timeout=10) == 3
        assert engine.locks == {theirs}
        for bad in ({"lock": theirs, "locks": [theirs]}, {}):
            reply = raw_request(endpoint, "FREE_LOOKUP_LOCKS", bad)
            assert reply["error"]["code"] == "BAD_ARGUMENT" and "one of 'lock' and 'locks'" in reply["error"]["message"]
        assert raw_request(endpoint, "FREE_LOOKUP_LOCKS", {"locks": []})["error"]["code"] == "BAD_ARGUMENT"
        assert other.free_lookup_locks_many_async([theirs]).result(timeout=10) == 1
    assert engine.locks == set()


def test_lookup_each_answers_each_prompt_as_a_lookup_in_one_request(endpoint: str, engine: FakeEngine) -> None:
    """LOOKUP_EACH (SGLang's pages through a server): each prompt's LOOKUP answer in order, their locks the
    session's; a prompt that is not packed ids refuses the request before anything is looked up or locked."""
    stored, missing = list(range(300, 308)), list(range(400, 408))
    prompts = [stored, missing, stored[:4]]
    with KvferryClient(endpoint) as client:
        reg = client.register_kv_cache(random_kv(4), FMT, namespace=NS)
        client.store(reg, stored, [0, 1, 2, 3])
        alone = [client.lookup(p, registration=reg) for p in prompts]
        found = client.lookup_each_async(prompts, registration=reg, lock=True).result(timeout=10)
        assert (
            [(f.tokens, f.pending) for f in found] == [(a.tokens, a.pending) for a in alone] == [(8, 0), (0, 0), (4, 0)]
        )
        locks = {f.lock for f in found if f.lock is not None}
        assert len(locks) == 2 and engine.locks == locks
        assert client.free_lookup_locks_many_async(list(locks)).result(timeout=10) == 2
        calls = engine.fake_calls._value.get()
        for bad, match in [([b"\0" * 8, b"\0" * 3], r"'prompts\[1\]'"), ([], "prompts")]:
            with pytest.raises(ServerError, match=f"BAD_ARGUMENT.*{match}"):
                client._call(lambda: client._conn.submit(Op.LOOKUP_EACH, {"prompts": bad, "registration": reg}))  # noqa: B023
        assert engine.fake_calls._value.get() == calls and engine.locks == set()


def test_a_failed_lookup_frees_the_locks_it_took(
    endpoint: str, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A LOOKUP_EACH whose later prompt fails, and a LOOKUP or LOOKUP_EACH whose tiers' answer fails, are
    refused with the locks they took freed: their client never learns the ids, so the session would keep them
    until the lock's timeout or its end."""
    stored = list(range(500, 508))
    pool_lookup = engine.lookup_pool

    def lookup_pool(tokens: Any, **options: Any) -> Any:
        if len(tokens) == 4:  # the prompt the pool itself fails on
            raise ValueError("the pool failed")
        found, _ = pool_lookup(tokens, **options)

        def tiers_fail() -> Any:
            raise ValueError("the tiers failed")

        return found, tiers_fail if len(tokens) == 6 else None  # a prompt after the hit's end asks the tiers

    monkeypatch.setattr(engine, "lookup_pool", lookup_pool)
    with KvferryClient(endpoint) as client:
        reg = client.register_kv_cache(random_kv(4), FMT, namespace=NS)
        client.store(reg, stored, [0, 1, 2, 3])
        for prompts in ([stored, stored[:4]], [stored, stored[:6]]):
            with pytest.raises(ServerError, match="failed"):
                client.lookup_each_async(prompts, registration=reg, lock=True).result(timeout=10)
            assert engine.locks == set()
        with pytest.raises(ServerError, match="the tiers failed"):
            client.lookup(stored[:6], registration=reg, lock=True)
        assert engine.locks == set()
        assert client.lookup(stored, registration=reg, lock=True).lock in engine.locks  # a lookup that answers
        assert client.end_session()["locks"] == 1


def test_lookup_lock_is_session_scoped_and_freed(endpoint: str, engine: FakeEngine) -> None:
    tokens = list(range(100, 108))
    with KvferryClient(endpoint) as owner, KvferryClient(endpoint) as other:
        reg = owner.register_kv_cache(random_kv(4), FMT, namespace=NS)
        owner.store(reg, tokens, [0, 1, 2, 3])
        lock = owner.lookup(tokens, registration=reg, lock=True).lock
        assert lock in engine.locks
        with pytest.raises(ServerError, match="UNKNOWN_LOCK"):
            other.free_lookup_locks(lock)
        assert owner.free_lookup_locks(lock) is True
        with pytest.raises(ServerError, match="UNKNOWN_LOCK"):
            owner.free_lookup_locks(lock)
        held = [owner.lookup(tokens, registration=reg, lock=True).lock for _ in range(3)]
        assert set(held) <= engine.locks
        assert owner.retrieve(reg, tokens, [4, 5, 6, 7], lock=held[0]) == 8
        assert held[0] not in engine.locks
        assert owner.end_session()["locks"] == 2
    assert engine.locks == set()

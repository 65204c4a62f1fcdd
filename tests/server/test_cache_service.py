"""The cache engine and the server tests' stand-in for it both are what the server needs (`CacheService`).

mypy checks this module (pyproject's ``[tool.mypy] files``): the annotated assignments below fail the type check
when either lacks a member or an argument of the protocol. The test checks the same at run time, member by member,
for a run without mypy.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator

import pytest

from kvferry.cache import CacheEngine, CacheNamespace, LookupResult
from kvferry.cache.keys import TokenIds
from kvferry.config import KvferryConfig
from kvferry.memory import HostPool
from kvferry.server import cache_service
from kvferry.server.cache_service import CacheService
from tests.server.serverkit import FakeEngine


@pytest.fixture
def engine() -> Iterator[CacheEngine]:
    config = KvferryConfig.load(env={}, overrides={"cache": {"chunk_size": 16}})
    with CacheEngine(config, pool=HostPool(1 << 20, pin=False)) as engine:
        yield engine


def _members() -> dict[str, object]:
    """The protocol's members by name, those of the protocols it extends included."""
    members: dict[str, object] = {}
    for cls in reversed(CacheService.__mro__):
        if cls.__module__ == cache_service.__name__:
            members.update({name: value for name, value in vars(cls).items() if not name.startswith("_")})
    return members


def _parameters(function: object) -> list[tuple[str, object, object]]:
    """Each parameter's name, kind and default (annotations aside: a string each, spelt as its module likes)."""
    assert callable(function)
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("make", [pytest.param("engine", id="CacheEngine"), pytest.param("fake", id="FakeEngine")])
def test_the_cache_engine_and_the_fake_have_every_member_the_server_calls(make: str, engine: CacheEngine) -> None:
    service: CacheService = engine if make == "engine" else FakeEngine()
    members = _members()
    assert {"lookup_pool", "store_steps", "retrieve_steps", "namespace_for", "chunk_size", "tiers"} <= set(members)
    for name, member in members.items():
        assert hasattr(service, name), f"{type(service).__name__} has no {name!r}"
        if isinstance(member, property):
            continue
        bound = getattr(service, name)
        expected = _parameters(member)[1:]  # the protocol's own `self` is not in a bound method's signature
        assert _parameters(bound) == expected, f"{type(service).__name__}.{name} takes other arguments"


class _Behind(FakeEngine):
    """A stand-in left behind when LOOKUP gained ``first_chunk`` (as the tests' fake once was)."""

    def lookup_pool(  # type: ignore[override]
        self,
        tokens: TokenIds,
        *,
        namespace: CacheNamespace | None = None,
        lock: bool = False,
        block_size: int | None = None,
    ) -> tuple[LookupResult, Callable[[], LookupResult] | None]:
        return super().lookup_pool(tokens, namespace=namespace, lock=lock, block_size=block_size)


def test_a_stand_in_that_lacks_an_argument_is_told_apart() -> None:
    """Both checks fail a stand-in without an argument of the protocol: mypy's (the ignore below is needed, or
    mypy reports it unused) and the member-by-member one above."""
    behind: CacheService = _Behind()  # type: ignore[assignment]
    expected = _parameters(_members()["lookup_pool"])[1:]
    assert _parameters(behind.lookup_pool) != expected
    assert _parameters(FakeEngine().lookup_pool) == expected

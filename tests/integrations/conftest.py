"""Fixtures of the tests that drive vLLM's own scheduler through `vllm_sim`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random-weight model on disk, as vLLM loads one (`vllm_sim.write_model`)."""
    from tests.integrations import vllm_sim

    return vllm_sim.write_model(tmp_path_factory.mktemp("model"))


@pytest.fixture
def engines() -> Iterator[list[Any]]:
    """Engines a test makes, shut down after it (their connectors wait for what is in flight)."""
    made: list[Any] = []
    yield made
    for engine in made:
        engine.shutdown()

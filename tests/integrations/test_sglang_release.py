"""kvferry's HiCache storage backend (`sglang_hicache_checks`), unified-cache linker (`sglang_linker_checks`; over
hybrid models' pools: `sglang_hybrid_checks`; loads in groups of layers: `sglang_layer_group_checks`) and recorded
device pools (`sglang_pool_checks`) under SGLang 0.5.23's own classes: the release's Python files
(`.ci/fetch-sglang-release` unpacks them, without compiled files) first on the path of a child pytest, whose process
alone holds the stand-in for torchvision that SGLang's KV pool imports need (`sglang_standin`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VERSION = "0.5.23"
TREE = Path(os.environ.get("KVF_TEST_SGLANG_RELEASE", ROOT / ".sglang-releases" / VERSION))
# CI fetches the release first (.ci/run) and sets this: a release missing there is a failure, not a skip.
REQUIRED = os.environ.get("KVF_TEST_SGLANG_RELEASE_REQUIRED") == "1"
pytestmark = pytest.mark.slow  # each check file runs in a child pytest that imports SGLang: 30-60 s on 2 cores


def test_the_hicache_storage_backend_under_sglang() -> None:
    run_checks("tests/integrations/sglang_hicache_checks.py")


def test_the_unified_cache_linker_under_sglang() -> None:
    run_checks("tests/integrations/sglang_linker_checks.py")


def test_the_unified_cache_linkers_loads_in_groups_of_layers_under_sglang() -> None:
    run_checks("tests/integrations/sglang_layer_group_checks.py")


def test_the_unified_cache_linker_under_sglangs_hybrid_models() -> None:
    run_checks("tests/integrations/sglang_hybrid_checks.py")


def test_the_recorded_device_pools_are_sglangs() -> None:
    run_checks("tests/integrations/sglang_pool_checks.py")


def run_checks(path: str) -> None:
    """The checks in ``path``, in a child pytest with SGLang's release first on the path; all of them pass."""
    if not (TREE / "sglang" / "__init__.py").is_file():
        message = f"SGLang {VERSION}'s Python files are not in {TREE} (run .ci/fetch-sglang-release)"
        if REQUIRED:
            pytest.fail(message)
        pytest.skip(message)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TREE), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "-W", "ignore::UserWarning", path],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    tail = child.stdout[-6000:] + child.stderr[-3000:]
    assert child.returncode == 0, f"SGLang {VERSION}:\n{tail}"
    summary = child.stdout.strip().splitlines()[-1]
    assert "passed" in summary and "skipped" not in summary and "failed" not in summary, f"SGLang {VERSION}: {summary}"

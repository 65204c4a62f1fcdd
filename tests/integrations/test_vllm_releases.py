"""The connector's vLLM tests again over each released vLLM kvferry supports besides the installed one: the release's
own Python files (`.ci/fetch-vllm-releases` unpacks them, without compiled files) first on the path of a child
pytest, over the installed vLLM's environment. Nothing there runs a kernel: vLLM's scheduler, KV cache manager,
configs and KV allocation are Python (`vllm_sim`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RELEASES = Path(os.environ.get("KVF_TEST_VLLM_RELEASES", ROOT / ".vllm-releases"))
# CI fetches the releases first (.ci/run) and sets this: a release missing there is a failure, not a skip.
REQUIRED = os.environ.get("KVF_TEST_VLLM_RELEASES_REQUIRED") == "1"
# What runs per release (one child pytest each, ~1 min on 2 cores): the connector under the release's scheduler
# (`test_vllm_sim`), how kvferry reads the release (`test_vllm_versions`), the tests of kvferry's reading of its
# configs and KV cache specs, and kvferry's blocks in its KV events (whose classes gain fields between releases).
TESTS = [
    "tests/integrations/test_vllm_sim.py",
    "tests/integrations/test_vllm_versions.py",
    "tests/integrations/test_vllm_state_settings.py",
    "tests/integrations/test_vllm_hybrid.py::test_groups_are_read_off_vllms_specs_and_mamba_is_refused",
    "tests/integrations/test_vllm_kv_events.py::test_embedded_kvferry_blocks_reach_vllms_kv_events",
]

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # a child pytest under each release: ~40 s on 2 cores


@pytest.mark.parametrize("version", ["0.33.0", "0.34.0"])
def test_the_connector_under_a_released_vllm(version: str) -> None:
    tree = RELEASES / version
    if not (tree / "vllm" / "__init__.py").is_file():
        message = f"vLLM {version}'s Python files are not in {tree} (run .ci/fetch-vllm-releases)"
        if REQUIRED:
            pytest.fail(message)
        pytest.skip(message)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "VLLM_TARGET_DEVICE": "cpu",  # the release's wheel is vLLM's CUDA build: its version names no CPU
        "KVF_TEST_VLLM_VERSION": version,
        "KVF_TEST_VLLM_TREE": str(tree),
    }
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", *TESTS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    tail = child.stdout[-6000:] + child.stderr[-3000:]
    assert child.returncode == 0, f"vLLM {version}:\n{tail}"
    summary = child.stdout.strip().splitlines()[-1]
    assert "passed" in summary and "skipped" not in summary and "failed" not in summary, f"vLLM {version}: {summary}"

"""What the connector decides at start from vLLM's settings: the chunk size where the user set none (a multiple of
vLLM's block size), a KV cache dtype it does not move (refused with the reason), how its workers reach the KV
(vLLM 0.34's ``kv_cache_access``)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvferry.connector.chunk_choice import chunk_size_for, follow_block_size
from kvferry.connector.settings import ConnectorSettings
from kvferry.cuda.vmm import fd_export_unavailable_reason
from kvferry.integrations.vllm import kv_access
from kvferry.integrations.vllm.kv_access import kv_cache_access
from kvferry.integrations.vllm.kv_layout import refused_cache_dtype

ROOT = Path(__file__).resolve().parents[2]
# vLLM 0.34's released Python files, as .ci/fetch-vllm-releases unpacks them (tests/integrations/test_vllm_releases.py)
VLLM_034 = Path(os.environ.get("KVF_TEST_VLLM_RELEASES", ROOT / ".vllm-releases")) / "0.34.0"
RELEASES_REQUIRED = os.environ.get("KVF_TEST_VLLM_RELEASES_REQUIRED") == "1"
SRC = ROOT / "src"


@pytest.mark.parametrize(("block_size", "chunk"), [(256, 256), (384, 384), (16, 256), (528, 528), (96, 288)])
def test_the_chunk_is_the_smallest_multiple_of_the_block_size_from_256_on(block_size: int, chunk: int) -> None:
    assert chunk_size_for([block_size]) == chunk
    user = ConnectorSettings(config={"cache": {"l1_size_gb": 0.25}})
    settings = follow_block_size(user, [block_size], announce=False)
    config = settings.kvferry_config()
    assert config.cache.chunk_size == chunk and config.cache.chunk_size % block_size == 0
    assert config.cache.l1_size_gb == 0.25  # the user's other settings kept
    settings.check_chunk_size(config.cache.chunk_size, block_size)  # what the connector checks: no error


def test_a_hybrid_model_s_chunk_holds_whole_blocks_of_every_group() -> None:
    assert chunk_size_for([16, 384]) == 384 and chunk_size_for([256, 384]) == 768 and chunk_size_for([64, 96]) == 384


def test_the_chosen_chunk_size_is_logged_at_info(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="kvferry"):
        follow_block_size(ConnectorSettings(), [528], announce=True)
    (record,) = [r for r in caplog.records if "chunk size 528" in r.getMessage()]
    assert record.levelno == logging.INFO and "block size 528" in record.getMessage()


def test_a_chunk_size_the_user_set_is_kept_and_still_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = ConnectorSettings(config={"cache": {"chunk_size": 384}})
    kept = follow_block_size(settings, [256], announce=True)
    assert kept.kvferry_config().cache.chunk_size == 384
    with pytest.raises(ValueError, match="384 is not a multiple of vLLM's block size = 256"):
        kept.check_chunk_size(384, 256)
    monkeypatch.setenv("KVFERRY_CACHE__CHUNK_SIZE", "384")  # set through the environment: kept too
    assert follow_block_size(ConnectorSettings(), [256], announce=False).kvferry_config().cache.chunk_size == 384


def test_server_mode_keeps_the_server_s_chunk_size() -> None:
    settings = ConnectorSettings(mode="server")
    assert follow_block_size(settings, [256], announce=True) is settings


@pytest.mark.parametrize(
    "dtype", ["octave_k3v4", "octave_k3v3_compact", "turboquant_k8v4", "nvfp4", "int8_per_token_head", "my_custom"]
)
def test_kv_cache_dtypes_kvferry_does_not_move_are_refused_with_the_reason(dtype: str) -> None:
    reason = refused_cache_dtype(dtype)
    assert reason is not None and repr(dtype) in reason and "'fp8_e4m3'" in reason


@pytest.mark.parametrize("dtype", ["auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2"])
def test_kv_cache_dtypes_kvferry_moves_are_not_refused(dtype: str) -> None:
    assert refused_cache_dtype(dtype) is None


class _TransferConfig:
    def __init__(self, extra: dict[str, object] | None) -> None:
        self.kv_connector_extra_config = extra


def test_server_mode_declares_exports_fd_over_the_unix_socket_where_descriptors_pass(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(kv_access, "fd_export_unavailable_reason", lambda: None)
    unix = {"mode": "server", "server_url": "ipc:///run/kvferry.sock"}
    with caplog.at_level(logging.INFO, logger="kvferry"):
        assert str(kv_cache_access(_TransferConfig(unix))).endswith("EXPORTS_FD")
    assert not [r for r in caplog.records if r.name.startswith("kvferry")]
    with caplog.at_level(logging.INFO, logger="kvferry"):  # descriptors cannot cross TCP
        assert str(kv_cache_access(_TransferConfig({"mode": "server"}))).endswith("LEGACY_IPC")
    assert any("tcp://127.0.0.1:5555" in r.getMessage() and "extensible KV cache is off" in r.getMessage()
               for r in caplog.records)  # fmt: skip


def test_server_mode_falls_back_to_legacy_ipc_where_the_platform_cannot_export_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(kv_access, "fd_export_unavailable_reason", lambda: "this CUDA driver lacks cuMemMap")
    unix = {"mode": "server", "server_url": "ipc:///run/kvferry.sock"}
    with caplog.at_level(logging.INFO, logger="kvferry"):
        assert str(kv_cache_access(_TransferConfig(unix))).endswith("LEGACY_IPC")
    assert any("lacks cuMemMap" in r.getMessage() for r in caplog.records)


def test_server_mode_shares_by_legacy_ipc_when_the_setting_asks(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(kv_access, "fd_export_unavailable_reason", lambda: None)
    extra = {"mode": "server", "server_url": "ipc:///run/kvferry.sock", "legacy_ipc": True}
    with caplog.at_level(logging.INFO, logger="kvferry"):
        assert str(kv_cache_access(_TransferConfig(extra))).endswith("LEGACY_IPC")
    assert any("legacy_ipc is set" in r.getMessage() for r in caplog.records)


def test_embedded_mode_declares_in_process_whatever_the_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    for reason in (None, "no driver"):
        monkeypatch.setattr(kv_access, "fd_export_unavailable_reason", lambda reason=reason: reason)
        assert str(kv_cache_access(_TransferConfig(None))).endswith("IN_PROCESS")
        assert str(kv_cache_access(_TransferConfig({"mode": "embedded"}))).endswith("IN_PROCESS")
    with pytest.raises(ValueError, match="mode"):
        kv_cache_access(_TransferConfig({"mode": "elsewhere"}))


def test_this_machine_s_answer_is_the_platform_check_s() -> None:
    """No stand-in: the real check (Linux, libcuda's VMM export calls) decides."""
    unix = {"mode": "server", "server_url": "ipc:///run/kvferry.sock"}
    expected = "EXPORTS_FD" if fd_export_unavailable_reason() is None else "LEGACY_IPC"
    assert str(kv_cache_access(_TransferConfig(unix))).endswith(expected)


def test_against_vllm_0_34_s_kv_cache_access_flags() -> None:
    """vLLM 0.34's own `KVTransferConfig` and `KVCacheAccess` (its Python sources first on the path)."""
    if not (VLLM_034 / "vllm" / "__init__.py").is_file():
        message = f"vLLM 0.34's Python files are not in {VLLM_034} (run .ci/fetch-vllm-releases)"
        if RELEASES_REQUIRED:
            pytest.fail(message)
        pytest.skip(message)
    script = f"""
import json, sys
sys.path[:0] = [{str(VLLM_034)!r}, {str(SRC)!r}]
from vllm.config.kv_transfer import KVCacheAccess, KVTransferConfig
from kvferry.integrations.vllm.kv_access import kv_cache_access
from kvferry.cuda.vmm import fd_export_unavailable_reason
answers = {{"exports": fd_export_unavailable_reason() is None}}
for mode, url in (("server", "tcp://127.0.0.1:5555"), ("server_unix", "ipc:///run/k.sock"), ("embedded", "")):
    extra = {{"mode": mode.removesuffix("_unix"), **({{"server_url": url}} if url else {{}})}}
    config = KVTransferConfig(kv_connector="KvferryConnector", kv_role="kv_both", kv_connector_extra_config=extra)
    access = kv_cache_access(config)
    answers[mode] = [type(access).__name__, access.name, KVCacheAccess.LEGACY_IPC in access]
print(json.dumps(answers))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers = json.loads(proc.stdout.strip().splitlines()[-1])
    unix = ["KVCacheAccess", "EXPORTS_FD", False] if answers.pop("exports") else ["KVCacheAccess", "LEGACY_IPC", True]
    assert answers == {
        "server": ["KVCacheAccess", "LEGACY_IPC", True],
        "server_unix": unix,
        "embedded": ["KVCacheAccess", "IN_PROCESS", False],
    }

"""KvferryConnector on a real vLLM (the CPU build), end to end, with a tiny random-weight Llama written here.

Four engines (see vllm_driver.py), each in a process of its own: a reference without kvferry; one with the cache
embedded (a miss, a hit, a hit with the loaded KV corrupted); two that share one kvferry server (a miss, then a
hit in the other, which runs vLLM's usual multiprocess layout). vLLM's own prefix cache is off, so every reused
token comes from kvferry. Finally the objects kvferry stored (read back from its disk tier) are checked against K
(after RoPE) and V computed from the weights.
"""

from __future__ import annotations

import importlib.util
import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None or importlib.util.find_spec("transformers") is None,
        reason="needs the vllm extra (pip install -e '.[vllm]')",
    ),
]

HERE = Path(__file__).resolve().parent
PROMPT_TOKENS = 1000
CHUNK = 256
HIT = PROMPT_TOKENS // CHUNK * CHUNK  # 768: the full chunks of the prompt
DRIVER_TIMEOUT_S = 300
LAYERS, KV_HEADS, HEAD_SIZE = 2, 2, 64


def run_driver(phase: str, tmp: Path, model: Path, prompt: Path, *extra: str) -> dict[str, Any]:
    out = tmp / f"{phase}-{time.monotonic_ns()}.json"
    cmd = [sys.executable, str(HERE / "vllm_driver.py"), phase, "--model", str(model), "--prompt", str(prompt)]
    proc = subprocess.run([*cmd, "--out", str(out), *extra], capture_output=True, text=True, timeout=DRIVER_TIMEOUT_S)
    assert proc.returncode == 0 and out.exists(), (
        f"{phase} driver failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-e2e")


@pytest.fixture(scope="module")
def model_dir(workdir: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_SIZE,
        max_position_embeddings=2048,
        initializer_range=0.2,  # larger than the default so greedy tokens depend on the context
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    path = workdir / "tiny-llama"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompt(workdir: Path) -> list[int]:
    rng = random.Random(7)
    tokens = [rng.randrange(1024) for _ in range(PROMPT_TOKENS)]
    (workdir / "prompt.json").write_text(json.dumps(tokens))
    return tokens


@pytest.fixture(scope="module")
def reference(workdir: Path, model_dir: Path, prompt: list[int]) -> dict[str, Any]:
    return run_driver("reference", workdir, model_dir, workdir / "prompt.json")


@pytest.fixture(scope="module")
def embedded(workdir: Path, model_dir: Path, prompt: list[int]) -> dict[str, Any]:
    tiers = workdir / "tier"
    return run_driver("embedded", workdir, model_dir, workdir / "prompt.json", "--tier-dir", str(tiers))


@pytest.fixture(scope="module")
def server_url(workdir: Path) -> Any:
    """A `kvferry server` process (the CLI, as users run it) on a free loopback port."""
    from kvferry.client import KvferryClient

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"tcp://127.0.0.1:{port}"
    flags = ["--port", str(port), "--no-http", "--chunk-size", str(CHUNK), "--l1-size-gb", "0.25"]
    log = (workdir / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "kvferry.cli", "server", *flags], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while True:  # ready once it answers a handshake
            assert proc.poll() is None, f"kvferry server exited: {(workdir / 'server.log').read_text()[-3000:]}"
            try:
                KvferryClient(url, timeout_s=2).close()
                break
            except TimeoutError:
                assert time.monotonic() < deadline, "kvferry server did not answer within 60 s"
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_reference_is_a_real_generation(reference: dict[str, Any]) -> None:
    (run,) = reference["runs"]
    assert run["cached"] == 0
    assert len(set(run["tokens"])) > 1  # the negative control below needs tokens that depend on the KV


def test_embedded_hit_reproduces_the_reference(reference: dict[str, Any], embedded: dict[str, Any]) -> None:
    miss, hit, _ = embedded["runs"]
    expected = reference["runs"][0]["tokens"]
    assert miss["cached"] == 0 and miss["tokens"] == expected
    assert hit["cached"] == HIT  # vLLM reports the prefix kvferry loaded
    assert hit["tokens"] == expected
    assert embedded["requests_held"] == 0  # the stored request's blocks went back once its stores were done


def test_corrupted_load_changes_the_tokens(reference: dict[str, Any], embedded: dict[str, Any]) -> None:
    corrupted = embedded["runs"][2]
    assert corrupted["cached"] == HIT
    assert embedded["corrupt_calls"] >= 1
    assert corrupted["tokens"] != reference["runs"][0]["tokens"]


def test_two_engines_share_one_server(
    workdir: Path, model_dir: Path, prompt: list[int], reference: dict[str, Any], server_url: str
) -> None:
    first = run_driver("server", workdir, model_dir, workdir / "prompt.json", "--server-url", server_url)
    # vLLM's default process layout: engine core and CPU worker in processes of their own, so the connector's
    # scheduler half looks up in the server by itself, in the key space its worker reported.
    second = run_driver(
        "server", workdir, model_dir, workdir / "prompt.json", "--server-url", server_url, "--multiprocessing"
    )
    expected = reference["runs"][0]["tokens"]
    assert first["runs"][0]["cached"] == 0 and first["runs"][0]["tokens"] == expected
    assert second["runs"][0]["cached"] == HIT
    assert second["runs"][0]["tokens"] == expected


def test_stored_objects_are_token_major_k_and_v(
    workdir: Path, model_dir: Path, prompt: list[int], embedded: dict[str, Any]
) -> None:
    from transformers import LlamaForCausalLM

    from kvferry.cache import CacheNamespace, ChunkHasher
    from kvferry.tiers import make_tier

    keys = ChunkHasher(embedded["chunk_size"], embedded["hash_algo"]).keys(
        prompt, CacheNamespace(**embedded["namespace"])
    )
    tier = make_tier(f"disk:{workdir / 'tier'}?size=1GB")
    try:
        objects = [tier.get(key, lambda shape, dtype: torch.empty(shape, dtype=dtype)).result() for key in keys]
    finally:
        tier.close()
    assert all(o is not None for o in objects), "an object kvferry stored is missing from its disk tier"
    stored = torch.cat(objects, dim=2).float()  # [2, NL, HIT, NH*HS]
    assert stored.shape == (2, LAYERS, HIT, KV_HEADS * HEAD_SIZE)

    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        cache = model(torch.tensor([prompt[:HIT]]), use_cache=True).past_key_values
    for kv, ref in ((0, cache.layers[0].keys), (1, cache.layers[0].values)):
        want = ref[0].permute(1, 0, 2).reshape(HIT, KV_HEADS * HEAD_SIZE)  # [T, NH*HS], K after RoPE
        err = (stored[kv, 0] - want).abs()
        scale = want.abs().max()
        print(f"layer 0 {'KV'[kv]}: max err {err.max():.4f} (max |ref| {scale:.3f}), mean err {err.mean():.5f}")
        assert err.max() < 0.02 * scale, f"{'KV'[kv]}: max error {err.max():.4f} vs max |ref| {scale:.4f}"
        assert err.mean() < 0.01 * want.abs().mean(), f"{'KV'[kv]}: mean error {err.mean():.5f}"

"""The end-to-end tests' module fixtures: a tiny random-weight Llama written here, the prompts every driver reads,
the reference run without kvferry, and a `kvferry server` process started as users start it."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integrations.vllm_e2e.kit import (
    BATCH,
    BATCH_TOKENS,
    CHAT_SEGMENTS,
    CHUNK,
    HEAD_SIZE,
    KV_HEADS,
    LAYERS,
    PROMPT_TOKENS,
    run_driver,
)
from tests.ports import free_ports


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
    batch = [[rng.randrange(1024) for _ in range(BATCH_TOKENS)] for _ in range(BATCH)]
    tp = {f"tp{i}": [rng.randrange(1024) for _ in range(PROMPT_TOKENS)] for i in (1, 2)}
    chat = [[rng.randrange(1024) for _ in range(n)] for n in CHAT_SEGMENTS]
    (workdir / "prompts.json").write_text(json.dumps({"main": tokens, "batch": batch, **tp, "chat": chat}))
    return tokens


@pytest.fixture(scope="module")
def reference(workdir: Path, model_dir: Path, prompt: list[int]) -> dict[str, Any]:
    return run_driver("reference", workdir, model_dir)


@pytest.fixture(scope="module")
def server_urls(workdir: Path) -> Iterator[tuple[str, str, str]]:
    """A `kvferry server` process (the CLI, as users run it) on a free loopback port and a Unix socket, publishing
    its KV events, its pool shared for direct loads: its tcp:// and ipc:// endpoints, and its event stream
    (PUB,REPLAY) as a connector's events_url."""
    from kvferry.client import KvferryClient

    port, pub, replay = free_ports(3)
    url = f"tcp://127.0.0.1:{port}"
    sockets = tempfile.mkdtemp(prefix="kvf-")  # short: a Unix socket path has ~100 bytes at most
    ipc_url = f"ipc://{sockets}/server.sock"
    flags = ["--port", str(port), "--no-http", "--chunk-size", str(CHUNK), "--l1-size-gb", "0.25", "--shared-pool"]
    flags += ["--ipc", ipc_url.removeprefix("ipc://")]
    flags += ["--events-port", str(pub), "--events-replay-port", str(replay)]
    log = (workdir / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "kvferry.cli", "server", *flags], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 60
        with KvferryClient(url, timeout_s=2) as client:
            while not client.wait_available(timeout_s=1):  # ready once it answers
                assert proc.poll() is None, f"kvferry server exited: {(workdir / 'server.log').read_text()[-3000:]}"
                assert time.monotonic() < deadline, "kvferry server did not answer within 60 s"
        yield url, ipc_url, f"tcp://127.0.0.1:{pub},tcp://127.0.0.1:{replay}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        shutil.rmtree(sockets, ignore_errors=True)


@pytest.fixture(scope="module")
def server_url(server_urls: tuple[str, str, str]) -> str:
    return server_urls[0]

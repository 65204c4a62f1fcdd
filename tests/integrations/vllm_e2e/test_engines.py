"""KvferryConnector on a real vLLM (the CPU build), end to end, with a tiny random-weight Llama (conftest.py).

Each engine runs in a process of its own (see vllm_driver.py): a reference without kvferry; one with the cache
embedded (a miss, a hit, a hit with the loaded KV corrupted, a hit whose load fails); one per CPU attention ISA and
per dtype; a 4 MiB pool over a disk tier serving a batch; two that share one kvferry server (the second in vLLM's
usual multiprocess layout); a tensor-parallel engine (TP=2) and whole ones sharing prefixes through the server; one
that starts before its server and outlives it; and one that must refuse a chunk size that is not a multiple of
vLLM's block size. The pool's engine and the tensor-parallel one (following the server's event stream) publish KV
events (--kv-events-config): what they announce for kvferry is checked against the prompts. vLLM's own prefix cache
is off, so every reused token comes from kvferry. Finally the objects kvferry stored (read back from its disk tier)
are checked against K (after RoPE) and V computed from the weights. Engines ended by a signal: test_signals.py.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvferry.client import KvferryClient
from tests.integrations.shm import pid_alive, shm_entries
from tests.integrations.vllm_e2e.kit import (
    BATCH,
    CHUNK,
    CHUNKS,
    GENERATED,
    HEAD_SIZE,
    HIT,
    KV_HEADS,
    LAYERS,
    MARKS,
    VLLM_BLOCK,
    assert_no_leak,
    cached_of,
    run_driver,
    tokens_of,
)

pytestmark = MARKS


@pytest.fixture(scope="module")
def embedded(workdir: Path, model_dir: Path, prompt: list[int]) -> dict[str, Any]:
    return run_driver("embedded", workdir, model_dir, "--tier-dir", str(workdir / "tier"))


def test_reference_is_a_real_generation(reference: dict[str, Any]) -> None:
    (run,) = reference["runs"]
    assert run["cached"] == [0] * (1 + BATCH)
    assert len(set(run["tokens"][0])) > 1  # the negative control below needs tokens that depend on the KV


def test_embedded_hit_reproduces_the_reference(reference: dict[str, Any], embedded: dict[str, Any]) -> None:
    miss, hit, _, _ = embedded["runs"]
    expected = reference["runs"][0]["tokens"][0]
    assert cached_of(miss) == 0 and tokens_of(miss) == expected
    assert cached_of(hit) == HIT  # vLLM reports the prefix kvferry loaded
    assert tokens_of(hit) == expected
    assert_no_leak(embedded)
    assert embedded["failure_policy"] == "recompute"
    counters = {**embedded["scheduler_counters"], **embedded["worker_counters"]}
    assert counters["lookup_requests"] == 4  # one per request, however often vLLM asked
    assert counters["lookup_hit_tokens"] == 3 * HIT and counters["hit_tokens_taken"] == 3 * HIT
    assert counters["tokens_loaded"] == 2 * HIT and counters["load_failures"] == 1
    assert counters["tokens_stored"] == HIT


def test_corrupted_load_changes_the_tokens(reference: dict[str, Any], embedded: dict[str, Any]) -> None:
    corrupted = embedded["runs"][2]
    assert cached_of(corrupted) == HIT
    assert embedded["corrupt_calls"] >= 1
    assert tokens_of(corrupted) != reference["runs"][0]["tokens"][0]


def test_a_failed_load_is_recomputed_not_failed(reference: dict[str, Any], embedded: dict[str, Any]) -> None:
    failed = embedded["runs"][3]
    assert failed["finish"] == ["length"]  # vLLM's default policy would have ended it with "error"
    assert tokens_of(failed) == reference["runs"][0]["tokens"][0]
    assert f"loaded 0 of {HIT} tokens; vLLM recomputes the rest" in embedded["output"]


def test_the_connector_says_it_is_active_in_vllms_output(embedded: dict[str, Any]) -> None:
    lines = [line for line in embedded["output"].splitlines() if "kvferry connector active" in line]
    assert len(lines) == 1, embedded["output"][-3000:]
    # vLLM's CPU backend writes bf16 KV in AMX tiles where the CPU has them, in its plain layout elsewhere
    layout = "VLLM_CPU_AMX_NL_X_NB_NH_KV_TILED" if _amx() else "VLLM_CPU_NL_X_NB_NH_KT_V"
    assert "embedded mode" in lines[0] and layout in lines[0] and "chunk size 256" in lines[0]
    assert lines[0].startswith("(") or "INFO" in lines[0]  # vLLM's own format: the line went through its handler


def test_an_error_while_serving_turns_the_connector_off_and_vllm_serves_on(
    workdir: Path, model_dir: Path, reference: dict[str, Any]
) -> None:
    report = run_driver("guard", workdir, model_dir, "--tier-dir", str(workdir / "guard-tier"))
    expected = reference["runs"][0]["tokens"][0]
    miss, tripped, after = report["runs"]
    assert [tokens_of(run) for run in report["runs"]] == [expected] * 3  # each as without kvferry
    assert cached_of(miss) == 0 and cached_of(after) == 0  # the tripped run recomputed its hit; then misses
    assert tripped["finish"] == after["finish"] == ["length"]
    errors = [line for line in report["output"].splitlines() if "kvferry connector turned off" in line]
    assert len(errors) == 1 and "KvferryConnector.build_connector_meta" in errors[0], report["output"][-3000:]
    assert "injected_drift" in report["output"] and "Traceback" in report["output"]
    assert report["requests_held"] == 0  # every block freed


def _amx() -> bool:
    return bool(torch.cpu._is_amx_tile_supported())


@pytest.mark.parametrize(
    ("isa", "dtype"),
    [
        ("vec", "bfloat16"),
        ("vec16", "bfloat16"),
        pytest.param(
            "amx",
            "bfloat16",
            marks=pytest.mark.skipif(not _amx(), reason="no AMX tiles on this CPU (vLLM's amx ISA would SIGILL)"),
        ),
        (None, "float16"),
    ],
    ids=["vec", "vec16", "amx", "fp16"],
)
def test_each_isa_and_dtype_hits_with_the_tokens_of_a_miss(
    workdir: Path, model_dir: Path, prompt: list[int], isa: str | None, dtype: str
) -> None:
    tier = workdir / f"tier-{isa}-{dtype}"
    flags = ["--dtype", dtype, "--tier-dir", str(tier), *(["--isa", isa] if isa else [])]
    report = run_driver("isa", workdir, model_dir, *flags)
    miss, hit = report["runs"]
    assert cached_of(miss) == 0 and len(set(tokens_of(miss))) > 1
    assert cached_of(hit) == HIT and tokens_of(hit) == tokens_of(miss)
    assert_no_leak(report)
    if isa:
        assert f"(CPU_ATTN, CPU attention ISA {isa})" in report["output"]


@pytest.fixture(scope="module")
def mla_model_dir(workdir: Path) -> Path:
    """A tiny random DeepSeek-V3 (MLA: a 512 + 64 latent per token, the only size vLLM's CPU MLA kernel takes)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=LAYERS,  # dense layers only
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=2048,
        initializer_range=0.2,
        tie_word_embeddings=False,
        rope_scaling=None,
    )
    torch.manual_seed(0)
    path = workdir / "tiny-deepseek-v3"
    DeepseekV3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def test_an_mla_model_on_the_cpu_computes_every_prompt_itself(
    workdir: Path, mla_model_dir: Path, prompt: list[int]
) -> None:
    """vLLM's CPU MLA attention gives other tokens over a prefix it did not compute (vLLM turns its own prefix
    caching off there; with a loaded prefix this model's tokens differ from the third on): the connector says so
    once and never offers a hit, so a repeated prompt gets the tokens of its first run."""
    report = run_driver("isa", workdir, mla_model_dir, "--tier-dir", str(workdir / "tier-mla"))
    miss, again = report["runs"]
    assert cached_of(miss) == cached_of(again) == 0
    assert tokens_of(miss) == tokens_of(again) and len(set(tokens_of(miss))) > 1
    assert "vLLM's CPU MLA attention cannot compute" in report["output"]


def test_a_tiny_pool_over_disk_serves_a_batch_without_failing_a_request(
    workdir: Path, model_dir: Path, prompt: list[int]
) -> None:
    """fp32, and the tokens compared with the same engine's first run (all misses, one batch): the later runs'
    requests wait for chunks coming up from disk, so they start at different steps, and a batch of another make-up
    rounds differently. In bf16 that flips this random model's greedy choice where its two best logits lie one
    rounding step apart (vLLM alone gives another continuation of one of these prompts run by itself)."""
    report = run_driver("pool", workdir, model_dir, "--tier-dir", str(workdir / "pool-tier"), "--dtype", "float32")
    first, *hits = report["runs"]
    assert first["cached"] == [0] * BATCH and all(len(set(tokens)) > 1 for tokens in first["tokens"])
    for run in report["runs"]:
        assert run["finish"] == ["length"] * BATCH
    for run in hits:
        assert run["tokens"] == first["tokens"]
    assert sum(report["runs"][-1]["cached"]) > 0  # later batches were served by kvferry, from the pool or disk
    assert_no_leak(report)
    prompts = json.loads((workdir / "prompts.json").read_text())
    assert_kv_events_name_the_prompts_blocks(report["kv_events"], prompts["batch"])
    # An index of the blocks the events say kvferry holds (pool or disk) predicts the hit vLLM reports for probes:
    # rounded down to whole chunks (what kvferry loads), short of it by less than a chunk (a tail, not announced).
    for probe in report["probes"]:
        whole = probe["predicted"] // CHUNK * CHUNK
        assert whole <= probe["cached"] < whole + CHUNK, probe
    continued, left = report["probes"]
    assert continued["predicted"] == 2 * CHUNK  # the first batch prompt's two whole chunks, held on disk or in the pool
    assert left["predicted"] == 3 * VLLM_BLOCK and left["cached"] == CHUNK  # left inside chunk 2: one block too many


def assert_kv_events_name_the_prompts_blocks(
    events: list[dict[str, Any]], prompts: list[list[int]], *, spilled: bool = True
) -> dict[Any, list[int]]:
    """What vLLM published for kvferry (--kv-events-config, decoded with vLLM's classes): each block announced in
    the pool (CPU) holds one of ``prompts``' tokens at its place (followed through its parent hashes); each block's
    stays in a medium alternate stored, removed (a removal once); with ``spilled``, the pool evicted and spilled to
    disk (medium STORAGE). Returns each announced block's prefix (its tokens and every block's before it)."""
    tokens: dict[Any, list[int]] = {}
    parent: dict[Any, Any] = {}
    last: dict[tuple[Any, str], str] = {}
    for event in events:
        for i, h in enumerate(event["hashes"]):
            assert last.get((h, event["medium"]), "BlockRemoved") != event["type"], (h, event)
            last[h, event["medium"]] = event["type"]
            if event["type"] == "BlockStored" and event["medium"] == "CPU":
                assert event["block_size"] == VLLM_BLOCK
                tokens[h] = event["tokens"][i * VLLM_BLOCK : (i + 1) * VLLM_BLOCK]
                parent[h] = event["hashes"][i - 1] if i else event["parent"]
    assert tokens and {e["medium"] for e in events} == ({"CPU", "STORAGE"} if spilled else {"CPU"})
    if spilled:
        assert any(e["type"] == "BlockRemoved" and e["medium"] == "CPU" for e in events)
    prefixes = {}
    for block in tokens:
        prefix: list[int] = []
        h = block
        while h is not None:
            prefix[:0] = tokens[h]
            h = parent[h]
        assert any(p[: len(prefix)] == prefix for p in prompts), prefix[:8]
        prefixes[block] = prefix
    return prefixes


def test_a_chunk_that_is_not_whole_blocks_is_refused_at_start(workdir: Path, model_dir: Path) -> None:
    report = run_driver("bad-chunk", workdir, model_dir)
    assert report["error"] is not None
    assert (
        "cache.chunk_size" in report["error"]
        and "= 200 is not a multiple of vLLM's block size = 128" in report["error"]
    )


def test_two_engines_share_one_server(
    workdir: Path, model_dir: Path, prompt: list[int], reference: dict[str, Any], server_urls: tuple[str, str, str]
) -> None:
    tcp_url, ipc_url, _ = server_urls
    first = run_driver("server", workdir, model_dir, "--server-url", tcp_url)
    # vLLM's default process layout: engine core and CPU worker in processes of their own, so the connector's
    # scheduler half looks up in the server by itself, in the key space its worker reported; over the server's
    # Unix socket, where the first engine stored over TCP; its worker copies the hit out of the server's shared
    # pool itself (direct loads), where the scheduler half's lookup located it: no LOCATE on the load's path.
    with KvferryClient(tcp_url) as client:
        located = client.stats()["cache"]["located_chunks"]
        locates = client.stats()["server"]["requests"].get("LOCATE", {}).get("ok", 0)
    second = run_driver("server", workdir, model_dir, "--server-url", ipc_url, "--multiprocessing", "--direct-loads")
    expected = reference["runs"][0]["tokens"][0]
    assert cached_of(first["runs"][0]) == 0 and tokens_of(first["runs"][0]) == expected
    assert cached_of(second["runs"][0]) == HIT
    assert tokens_of(second["runs"][0]) == expected
    with KvferryClient(tcp_url) as client:
        stats = client.stats()
    assert stats["cache"]["located_chunks"] - located == HIT // CHUNK + 1  # its chunks and tail, copied by the engine
    assert stats["server"]["requests"]["LOCATE"]["ok"] == locates + 1  # the worker's, mapping the pool at its start
    assert "not direct" not in second["output"]
    assert_no_leak(first)


def test_a_tensor_parallel_engine_shares_prefixes_with_whole_engines(
    workdir: Path, model_dir: Path, prompt: list[int], server_urls: tuple[str, str, str]
) -> None:
    """TP=2 ranks (processes of their own) each store and load their half of the KV heads through the server; a
    TP=1 engine reads what they stored and they read what it stored. fp32, so the ranks' all-reduce rounds as the
    TP=1 engine's GEMM does and a hit's tokens can be compared with a miss's of the other engine. The TP=2 engine
    publishes KV events (following the server's stream): one emitter whatever the ranks, each block once."""
    server_url, _, events_url = server_urls
    fp32 = ("--server-url", server_url, "--dtype", "float32")
    first = run_driver("server", workdir, model_dir, *fp32, "--runs", "tp1")
    with_events = ("--events-url", events_url)
    ranks = run_driver("server", workdir, model_dir, *fp32, *with_events, "--tp", "2", "--runs", "tp1,tp2,tp2")
    last = run_driver("server", workdir, model_dir, *fp32, "--runs", "tp2")
    hit_of_whole, miss, hit = ranks["runs"]
    assert cached_of(first["runs"][0]) == 0
    assert cached_of(hit_of_whole) == HIT and tokens_of(hit_of_whole) == tokens_of(first["runs"][0])
    assert cached_of(miss) == 0
    assert cached_of(hit) == HIT and tokens_of(hit) == tokens_of(miss)
    assert cached_of(last["runs"][0]) == HIT and tokens_of(last["runs"][0]) == tokens_of(miss)
    assert "kvferry connector active" in ranks["output"]
    prompts = json.loads((workdir / "prompts.json").read_text())
    events = ranks["kv_events"]
    prefixes = assert_kv_events_name_the_prompts_blocks(events, [prompts["tp1"], prompts["tp2"]], spilled=False)
    assert not [e for e in events if e["type"] == "BlockRemoved"]  # nothing evicted from the 256 MiB pool
    # the tp2 prompt's whole chunks, stored by the two ranks together and announced once
    assert sorted(len(p) for p in prefixes.values() if p == prompts["tp2"][: len(p)]) == list(
        range(VLLM_BLOCK, CHUNKS + 1, VLLM_BLOCK)
    )


def test_a_server_absent_at_start_and_killed_mid_run_costs_no_request_and_no_time(
    workdir: Path, model_dir: Path, reference: dict[str, Any]
) -> None:
    before = shm_entries()
    report = run_driver("resilience", workdir, model_dir)
    expected = reference["runs"][0]["tokens"][0]
    assert all(run["finish"] == ["length"] and tokens_of(run) == expected for run in report["runs"])
    assert [cached_of(run) for run in report["runs"]] == [0, 0, HIT, 0, 0, 0, 0, 0]
    assert report["engine_start_seconds"] < 60  # one 2 s handshake attempt at most, not a 30 s wait
    assert report["after_kill_seconds"] < 20  # 5 requests: one lookup times out (2 s), then immediate misses
    output = report["output"]
    assert output.count("is unavailable") == 2  # one warning per outage, however many requests
    assert "kvferry/integrations" not in output  # no traceback through the connector (vLLM prints its own)
    assert_no_leak(report)
    # The driver has exited: a torch name of a process still alive is another test run's.
    assert not {e for e in shm_entries() - before if e.startswith("torch_") and not pid_alive(e.split("_")[1])}


@pytest.mark.parametrize("mode", ["embedded", "server"])
def test_each_turn_of_a_chat_hits_the_last_turns_prompt_and_output_but_for_less_than_a_block(
    mode: str, workdir: Path, model_dir: Path, reference: dict[str, Any], request: pytest.FixtureRequest
) -> None:
    extra = ["--server-url", request.getfixturevalue("server_url")] if mode == "server" else []
    report = run_driver("chat", workdir, model_dir, *extra)
    turns = report["runs"]
    assert [tokens_of(t) for t in turns] == [tokens_of(t) for t in reference["chat"]]
    assert cached_of(turns[0]) == 0
    for before, turn in itertools.pairwise(turns):
        said = before["prompt_tokens"] + GENERATED  # the last turn's prompt and output: all in this prompt
        # What the last turn computed (its last token's KV never was) in whole blocks: full chunks and a tail.
        assert cached_of(turn) == (said - 1) // VLLM_BLOCK * VLLM_BLOCK
        assert 0 < said - cached_of(turn) <= VLLM_BLOCK
    assert any(cached_of(t) % CHUNK for t in turns)  # hits past the last full chunk: tails
    if mode == "embedded":
        assert_no_leak(report)


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
    stored = torch.cat(objects, dim=2).float()  # [2, NL, CHUNKS, NH*HS]: tails stay in the pool
    assert stored.shape == (2, LAYERS, CHUNKS, KV_HEADS * HEAD_SIZE)

    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        cache = model(torch.tensor([prompt[:CHUNKS]]), use_cache=True).past_key_values
    for kv, ref in ((0, cache.layers[0].keys), (1, cache.layers[0].values)):
        want = ref[0].permute(1, 0, 2).reshape(CHUNKS, KV_HEADS * HEAD_SIZE)  # [T, NH*HS], K after RoPE
        err = (stored[kv, 0] - want).abs()
        scale = want.abs().max()
        print(f"layer 0 {'KV'[kv]}: max err {err.max():.4f} (max |ref| {scale:.3f}), mean err {err.mean():.5f}")
        assert err.max() < 0.02 * scale, f"{'KV'[kv]}: max error {err.max():.4f} vs max |ref| {scale:.4f}"
        assert err.mean() < 0.01 * want.abs().mean(), f"{'KV'[kv]}: mean error {err.mean():.5f}"

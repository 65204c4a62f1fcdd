"""Runs one vLLM engine over a tiny random-weight hybrid model (sliding-window and full attention layers).

    python vllm_hybrid_driver.py PHASE --model DIR --out FILE [--server-url URL] [--multiprocessing] [--tp N]

PHASE
  model       write the model (Gemma 3: layers 0 and 2 slide over WINDOW tokens, 1 and 3 attend to everything),
              and a state-space hybrid next to it (Qwen3-Next: gated delta-net linear attention in layers 0 and 2).
  reference   no connector: each prompt once.
  embedded    kvferry's cache in this process: the main prompt (a miss), again (a hit), the other prompt (a hit of
              the shared prefix, well past the window), each after the other.
  server      the same through a kvferry server at --server-url.
  gdn, gdn-reference, gdn-lost, gdn-server
              the state-space hybrid with vLLM's prefix caching on (Mamba "align" mode): without kvferry the main
              prompt once, then a chat's two turns; with kvferry embedded the main prompt (a miss, stored), vLLM's
              prefix cache emptied, the main prompt again (kvferry's hit: attention chunks and the linear-attention
              state at its end); ``gdn-lost`` as ``gdn`` with every state load writing zeros instead (what the test
              tells apart); ``gdn-server`` as ``gdn`` through a kvferry server at --server-url (with
              --multiprocessing: in vLLM's default process layout).
  gdn-chat-reference
              no connector, vLLM's prefix caching alone: a chat's two turns (as ``gdn-chat``, the cache kept), turn
              2 a hit of vLLM's own on the state it kept (``--retention N``).
  gdn-chat    the state-space hybrid, kvferry embedded: a chat's turn 1 (CHAT_PROMPT tokens, CHAT_OUTPUT generated:
              past a chunk boundary), vLLM's prefix cache emptied, turn 2 (turn 1's prompt and output, then more);
              ``--retention N``: vLLM's prefix_cache_retention_interval (which Mamba states it keeps and hands over).
              ``--foreground`` (``gdn``, ``gdn-lost``): the connector set to load before the forward pass
              (``async_load`` false), which a model of several KV cache groups does not take.
  capacity    vLLM's KV capacity in tokens with the connector on, with vLLM's hybrid KV cache manager and without
              (``disable_hybrid_kv_cache_manager``): every layer then holds every token.

``--multiprocessing``: vLLM's engine core and worker in processes of their own (the connector's scheduler half
then looks up apart from its KV); ``--tp N``: N tensor-parallel workers (server mode).
Writes a JSON report (tokens, vLLM's cached tokens, the connector's counters,
vLLM's KV cache groups, the bytes the connector copied).
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from vllm_driver import CHUNK_SIZE, ENGINE_ENV, connector_state, generate, write_report  # noqa: E402

WINDOW = 128
PROMPT_TOKENS = 1000  # the hit: its 3 full chunks (768 tokens), six windows long
SHARED_TOKENS = 768  # the other prompt shares this prefix with the main one
VOCAB = 1024
CHAT_PROMPT, CHAT_OUTPUT = 700, 80  # turn 1 ends at 780 tokens: its output crosses the boundary at 768


def prompts() -> dict[str, list[int]]:
    rng = random.Random(7)
    main = [rng.randrange(3, VOCAB) for _ in range(PROMPT_TOKENS)]
    other = main[:SHARED_TOKENS] + [rng.randrange(3, VOCAB) for _ in range(PROMPT_TOKENS - SHARED_TOKENS)]
    return {"main": main, "other": other}


def write_model(path: str) -> None:
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def write_gdn_model(path: str) -> None:
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,  # vLLM pads the state's page to whole attention blocks (384 tokens, 256 on some CPUs)
        head_dim=128,
        linear_key_head_dim=128,  # vLLM's CPU kernel takes no smaller head
        linear_value_head_dim=128,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        num_experts=4,
        num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention"] * 2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(config)
    # A wrong state must change the greedy tokens: the linear-attention layers' output weighs in, and their state
    # decays slowly (a random A_log decays it by 0.7 a token or faster: 232 tokens after a hit it is gone, and any
    # state there gives the same tokens; A_log -6 keeps about half of it over those tokens).
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "linear_attn.out_proj" in name:
                weight.mul_(100)
            if name.endswith("linear_attn.A_log"):
                weight.fill_(-6.0)
    model.to(torch.bfloat16).save_pretrained(path)


def lose_state_loads() -> None:
    """Make every Mamba state load write zeros into its block and report success (``gdn-lost``)."""
    from concurrent.futures import Future

    from kvferry.connector.state_groups import StateBackend

    def zeros(self: Any, tokens: list[int], block_ids: list[int], skip: int) -> Future[int]:
        for layer in self.backend.kv.layers:
            layer[block_ids[-1]] = 0
        done: Future[int] = Future()
        done.set_result(len(tokens))
        return done

    StateBackend.retrieve_async = zeros  # type: ignore[method-assign]


def make_llm(model: str, extra: dict[str, Any] | None, **options: Any) -> Any:
    from vllm import LLM

    kv_transfer = None
    if extra is not None:
        kv_transfer = {
            "kv_connector": "KvferryConnector",
            "kv_connector_module_path": "kvferry.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    return LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        seed=0,
        kv_transfer_config=kv_transfer,
        # vLLM's own prefix cache off: every reused token comes from kvferry
        **{"max_model_len": 2048, "enable_prefix_caching": False, **options},
    )


def kv_groups(llm: Any) -> list[dict[str, Any]]:
    config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    return [
        {
            "kind": type(g.kv_cache_spec).__name__,
            "layers": list(g.layer_names),
            "window": getattr(g.kv_cache_spec, "sliding_window", None),
            "block_size": g.kv_cache_spec.block_size,
            "mamba_cache_mode": getattr(g.kv_cache_spec, "mamba_cache_mode", None),
        }
        for g in config.kv_cache_groups
    ]


def kv_capacity_tokens(llm: Any) -> int:
    """Tokens of context vLLM's KV cache holds for one request of this model (vLLM's own count)."""
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    vllm_config = llm.llm_engine.vllm_config
    config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    return int(get_max_concurrency_for_kv_cache_config(vllm_config, config) * vllm_config.model_config.max_model_len)


def count_copied_bytes(moved: dict[str, int]) -> None:
    """Add the bytes each load and store of an embedded backend copies (per direction) to ``moved``."""
    from kvferry.connector.backends import EmbeddedBackend

    for name, direction in (("retrieve_async", "loaded"), ("store_async", "stored")):
        original = getattr(EmbeddedBackend, name)

        def counted(self: Any, tokens: Any, block_ids: Any, skip: int, _run: Any = original, _to: str = direction):
            future = _run(self, tokens, block_ids, skip)
            per_token = self.geometry.bytes_per_token
            done = (lambda f: f.result() - skip) if _to == "loaded" else (lambda f: f.result())
            future.add_done_callback(lambda f: moved.__setitem__(_to, moved[_to] + done(f) * per_token))
            return future

        setattr(EmbeddedBackend, name, counted)


def chat(llm: Any, *, reset: bool = True) -> list[dict[str, Any]]:
    """A chat's two turns: turn 2's prompt is turn 1's prompt and output, then new tokens. Between the turns, a
    short request (a step after turn 1's stores) and, where ``reset``, vLLM's prefix cache emptied (a hit can only
    be kvferry's)."""
    rng = random.Random(11)
    prompt = [rng.randrange(3, VOCAB) for _ in range(CHAT_PROMPT)]
    first = generate(llm, [prompt], max_tokens=CHAT_OUTPUT)
    generate(llm, [list(range(16))])
    first["prefix_cache_reset"] = reset and llm.reset_prefix_cache()
    second = generate(llm, [prompt + first["tokens"][0] + [rng.randrange(3, VOCAB) for _ in range(20)]])
    return [first, second]


def run_gdn(
    model: str, phase: str, retention: int | None, server_url: str | None, *, foreground: bool = False
) -> dict[str, Any]:
    """The state-space hybrid's phases (see the module's docstring), vLLM's prefix caching on; ``foreground``: the
    connector loads a hit before the forward pass of the step that schedules it (``async_load`` false)."""
    main_prompt = prompts()["main"]
    if phase == "gdn-lost":
        lose_state_loads()
    # No chunk size: it follows vLLM's block size, which vLLM picks for the machine (`chunk_choice`).
    extra: dict[str, Any] = {
        "mode": "embedded",
        "config": {"cache": {"l1_size_gb": 0.25}},
        "async_load": not foreground,
    }
    if phase == "gdn-server":
        extra = {"mode": "server", "server_url": server_url}
    kept = {} if retention is None else {"prefix_cache_retention_interval": retention}
    reference = phase in ("gdn-reference", "gdn-chat-reference")
    llm = make_llm(model, None if reference else extra, enable_prefix_caching=True, **kept)
    in_process = os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # else the test asks the server for counters
    report: dict[str, Any] = {"groups": kv_groups(llm) if in_process else []}
    if phase == "gdn-reference":
        report["runs"] = [generate(llm, [main_prompt])]
        report["chat"] = chat(llm)
    elif phase == "gdn-chat-reference":
        report["chat"] = chat(llm, reset=False)
    elif phase == "gdn-chat":
        report["chat"] = chat(llm)
    else:
        report["runs"] = [generate(llm, [main_prompt])]
        generate(llm, [list(range(16))])  # a step after the first run's stores: vLLM then frees its blocks
        report["prefix_cache_reset"] = llm.reset_prefix_cache()
        report["runs"].append(generate(llm, [main_prompt]))
    if not reference and in_process:
        report.update(connector_state(llm))
    llm.llm_engine.engine_core.shutdown()
    return report


def main() -> None:
    phase, model = sys.argv[1], sys.argv[sys.argv.index("--model") + 1]
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    if phase == "model":
        write_model(model)
        write_gdn_model(model + "-gdn")
        write_report(out, {"phase": phase})
        return
    tp = int(sys.argv[sys.argv.index("--tp") + 1]) if "--tp" in sys.argv else 1
    if tp > 1:  # a CPU per rank for its OpenMP threads
        cpus = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cpus[r % len(cpus)]) for r in range(tp))
    for name, value in ENGINE_ENV.items():
        os.environ.setdefault(name, value)
    multiprocessing = "--multiprocessing" in sys.argv or tp > 1  # the connector's scheduler half apart from its KV
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
    embedded = {"mode": "embedded", "config": {"cache": {"chunk_size": CHUNK_SIZE, "l1_size_gb": 0.25}}}
    report: dict[str, Any] = {"phase": phase}
    if phase == "capacity":
        for hma in (True, False):  # long requests, prefilled in steps: what a windowed group frees counts
            llm = make_llm(
                model, embedded, disable_hybrid_kv_cache_manager=not hma, max_num_batched_tokens=512,
                max_model_len=4096,
            )  # fmt: skip
            report["hma" if hma else "no_hma"] = {"groups": kv_groups(llm), "tokens": kv_capacity_tokens(llm)}
            llm.llm_engine.engine_core.shutdown()
            del llm
        write_report(out, report)
        os._exit(0)
    if phase.startswith("gdn"):
        retention = int(sys.argv[sys.argv.index("--retention") + 1]) if "--retention" in sys.argv else None
        url = sys.argv[sys.argv.index("--server-url") + 1] if "--server-url" in sys.argv else None
        report.update(run_gdn(model + "-gdn", phase, retention, url, foreground="--foreground" in sys.argv))
        write_report(out, report)
        os._exit(0)
    extra = {
        "reference": None,
        "embedded": embedded,
        "server": {
            "mode": "server",
            "server_url": sys.argv[sys.argv.index("--server-url") + 1] if phase == "server" else "",
        },
    }[phase]
    moved = {"loaded": 0, "stored": 0}
    count_copied_bytes(moved)
    llm = make_llm(model, extra, tensor_parallel_size=tp)
    if not multiprocessing:  # else the test reads them off the connector's log line
        report["groups"] = kv_groups(llm)
    texts = prompts()
    order = ["main", "other"] if phase == "reference" else ["main", "main", "other"]
    report["runs"] = [generate(llm, [texts[name]]) for name in order]
    if not multiprocessing and phase != "reference":
        report.update(connector_state(llm))
        report["bytes"] = dict(moved)
        config = llm.llm_engine.vllm_config.model_config  # every layer's K and V of one token, bf16
        layers = config.hf_text_config.num_hidden_layers
        report["bytes_per_token_all_layers"] = layers * 2 * config.get_total_num_kv_heads() * config.get_head_size() * 2
    llm.llm_engine.engine_core.shutdown()
    write_report(out, report)
    os._exit(0)


if __name__ == "__main__":
    main()

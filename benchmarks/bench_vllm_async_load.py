"""vLLM step time while a prefix loads, as a script: `kvferry bench vllm-async-load`
(kvferry/bench/vllm_async_load_bench.py) and its flags. Needs the vllm extra.

    python3 benchmarks/bench_vllm_async_load.py [--prefix-tokens 8192] [--running 4] [--layers 16] [--kv-heads 8]
                                                [--json PATH]
"""

import sys

from kvferry.bench.vllm_async_load_bench import main

if __name__ == "__main__":
    sys.exit(main())

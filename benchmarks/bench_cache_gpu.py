"""One chunk through CacheEngine on a GPU engine, as a script: `kvferry bench cache-gpu`
(kvferry/bench/cache_gpu_bench.py). Needs CUDA.

    PYTHONPATH=src python3 benchmarks/bench_cache_gpu.py [--json PATH]
"""

import sys

from kvferry.bench.cache_gpu_bench import main

if __name__ == "__main__":
    sys.exit(main())

"""The GPU data path, as a script: `kvferry bench gpu-transfer` (kvferry/bench/gpu_transfer_bench.py), its flags, and
results also written to gpu_bench.json unless --json (or --out) names another file. Needs CUDA.

    PYTHONPATH=src python3 benchmarks/bench_gpu_transfer.py [--reps 15] [--sections bulk,formats,...] [--json PATH]
"""

import sys

from kvferry.bench.gpu_transfer_bench import main

if __name__ == "__main__":
    sys.exit(main())

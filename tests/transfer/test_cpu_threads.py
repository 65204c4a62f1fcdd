"""kvferry's threads in an engine's process run torch on one thread each: a parallel torch op there would start an
OpenMP team of its own, and libgomp then cuts the spin of every team, the engine's too (`cpu_threads`)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from kvferry.cache import CacheEngine
from kvferry.config import KvferryConfig
from kvferry.formats.kinds import EngineKVFormat as F
from kvferry.memory import HostPool
from tests.cache.cachekit import BS, CHUNK, assert_blocks_equal, make_paged

needs_threads = pytest.mark.skipif(torch.get_num_threads() < 2, reason="torch runs one thread here: nothing to limit")


_ONE_THREAD = """
from concurrent.futures import ThreadPoolExecutor
import torch
from kvferry.kernels import cpu_threads
with ThreadPoolExecutor(1) as plain:
    count = plain.submit(torch.get_num_threads).result()
with ThreadPoolExecutor(1, initializer=cpu_threads.torch_on_one_thread) as pool:
    inside = pool.submit(lambda: (torch.get_num_threads(), cpu_threads.copy_threads())).result()
print(count, *inside, cpu_threads.copy_threads(), cpu_threads.on_own_threads())
"""


@needs_threads
def test_a_thread_made_single_threaded_copies_over_the_process_count() -> None:
    # In a fresh process: other tests here set this process's torch threads and kvferry's own copy threads.
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", _ONE_THREAD], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    count, inside, copies, main_copies, main_own = done.stdout.split()
    assert (count, inside, copies) == ("2", "1", "2")  # one thread of its own, copies over the process's count
    assert (main_copies, main_own) == ("None", "False")  # the calling thread: as it was


def _native_threads() -> set[int]:
    """This process's threads that Python did not start (OpenMP's and other libraries' own)."""
    python = {t.native_id for t in threading.enumerate()}
    return {int(tid) for tid in os.listdir("/proc/self/task")} - python


@needs_threads
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
@pytest.mark.parametrize("fmt", [F.NL_X_TWO_NB_BS_NH_HS, F.VLLM_CPU_NL_X_NB_NH_KT_V])
def test_stores_and_retrieves_on_the_engines_threads_start_no_openmp_team(fmt: F) -> None:
    nb, blocks = 256, 128  # pieces far above torch's grain size: a parallel op would start a team
    src, dst = make_paged(fmt, nb, seed=1), make_paged(fmt, nb, seed=2)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32_000, size=blocks * BS).tolist()
    src_ids, dst_ids = rng.permutation(nb)[:blocks].tolist(), rng.permutation(nb)[:blocks].tolist()
    config = KvferryConfig.load(env={}, overrides={"cache": {"chunk_size": CHUNK}})
    before = _native_threads()
    with CacheEngine(config, pool=HostPool(64 << 20, pin=False)) as engine:
        engine.namespace = engine.namespace_for("test-model", fmt, src)
        assert engine.store_async(tokens, src, src_ids, fmt).result(timeout=60) == blocks * BS
        assert engine.retrieve_async(tokens, dst, dst_ids, fmt).result(timeout=60) == blocks * BS
        assert _native_threads() - before == set()
    assert_blocks_equal(src, src_ids, dst, dst_ids, fmt)

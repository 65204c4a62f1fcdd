"""vLLM engines (the CPU build) with the connector on, ended by a signal as a terminal's Ctrl-C, a service manager
or the kernel ends them: the connector's shutdown stays within its bound, and nothing is left in /dev/shm."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integrations.shm import group_pids, left_behind, shm_entries
from tests.integrations.vllm_e2e.kit import DRIVER, DRIVER_TIMEOUT_S, MARKS

pytestmark = MARKS

# After a Ctrl-C, vLLM's own teardown (its collections and process groups, the interpreter's exit) took 3-9 s on a
# loaded 2-core machine, with or without the connector; the connector's shutdown within it is bounded apart.
SIGNALLED_EXIT_S = 30
CONNECTOR_SHUTDOWN_S = 5.0  # its link's close takes 2 s at most, whether or not the server answers
SHM_CLEANUP_S = 15.0


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["SIGINT", "SIGTERM", "SIGKILL"])
def test_an_engine_ended_by_a_signal_leaves_nothing_in_dev_shm(
    workdir: Path, model_dir: Path, prompt: list[int], server_url: str, how: signal.Signals
) -> None:
    before = shm_entries()
    out = workdir / f"hold-{how.name}.json"
    cmd = [sys.executable, str(DRIVER), "hold", "--model", str(model_dir)]
    cmd += ["--prompts", str(workdir / "prompts.json"), "--out", str(out), "--server-url", server_url]
    # Its own process group, signalled as a whole as a terminal's Ctrl-C does (torch's shm manager included).
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + DRIVER_TIMEOUT_S
        while not out.exists():
            assert proc.poll() is None, "the engine exited before it was signalled"
            assert time.monotonic() < deadline, "the engine did not serve its request in time"
            time.sleep(0.2)
        assert json.loads(out.read_text())["runs"][0]["finish"] == ["length"]
        pids = group_pids(proc.pid)
        os.killpg(proc.pid, how)
        proc.wait(timeout=SIGNALLED_EXIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if how == signal.SIGINT:  # a clean exit, the connector's shutdown in it (SIGTERM and SIGKILL leave no time for one)
        took = [float(line) for line in out.with_suffix(".shutdown").read_text().split()]
        assert took and max(took) < CONNECTOR_SHUTDOWN_S, f"the connector's shutdown took {took} s"
    # The group's other processes go too, and what cleans up after them (vLLM's cpushm files went 1 s after a
    # SIGKILL on a quiet machine, later beside another test's engine): waited for, up to a bound.
    deadline = time.monotonic() + SHM_CLEANUP_S
    while (left := left_behind(before, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == set(), "shared memory left behind"

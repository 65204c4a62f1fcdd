"""`kvferry formats`: every engine KV layout kvferry knows, derived from the declarations in `kvferry.formats`."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from kvferry.formats import LAYOUTS, EngineKVFormat, Layout

COLUMNS = ("id", "name", "nesting x axes", "kv_size", "object shape", "engines")


def object_shape_rule(layout: Layout) -> str:
    """The chunk-object shape `[kv_size, NL, chunk, W]` with W written in the layout's own sizes."""
    if "NP" in layout.nesting:
        width = "sum of plane HS"
    elif layout.fused and layout.split_tail is None:
        width = "NH*2*HS" if "NH" in layout.axes else "2*HS"
    else:
        width = "NH*HS" if "NH" in layout.axes else "HS"
    sizes = " or ".join(map(str, layout.element_sizes or ()))
    unit = f" ({sizes}-byte elements)" if sizes else ""
    return f"[{layout.kv_size}, NL, chunk, {width}]{unit}"


def nesting_and_axes(layout: Layout) -> str:
    nest = "".join(f"{level} x " for level in layout.nesting)
    axes = list(layout.axes)
    if layout.split_tail is not None:  # the (BS, CS) tail holds a K block then a V block, each in its own order
        k, v = (", ".join(order) for order in layout.split_tail)
        axes[-2:] = [f"(K [{k}], V [{v}])"]
    return f"{nest}[{', '.join(axes)}]"


def rows() -> list[tuple[str, ...]]:
    return [
        (
            str(fmt.value),
            fmt.name,
            nesting_and_axes(layout),
            str(layout.kv_size),
            object_shape_rule(layout),
            layout.engines,
        )
        for fmt, layout in sorted(LAYOUTS.items())
    ]


def add_formats_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table (as in README.md)")


def run_formats(args: argparse.Namespace, console: Console) -> int:
    if args.markdown:
        console.print("| " + " | ".join(COLUMNS) + " |", markup=False, highlight=False, soft_wrap=True)
        console.print("|" + "---|" * len(COLUMNS), markup=False, highlight=False, soft_wrap=True)
        for row in rows():
            cells = [f"`{cell}`" if i in (1, 2, 4) else cell for i, cell in enumerate(row)]
            console.print("| " + " | ".join(cells) + " |", markup=False, highlight=False, soft_wrap=True)
        return 0
    table = Table(title=f"Engine KV formats ({len(EngineKVFormat)})", title_justify="left")
    for column in COLUMNS:
        table.add_column(
            column,
            justify="right" if column in ("id", "kv_size") else "left",
            no_wrap=column not in ("engines", "nesting x axes"),
        )
    for row in rows():
        table.add_row(*row)
    console.print(table)
    return 0

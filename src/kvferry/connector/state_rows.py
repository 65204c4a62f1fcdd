"""How a Mamba state's bytes are cut into the token rows of a chunk object (see `state_groups`): what a key space
needs to name a state object's layout for any chunk size, without the state's tensors."""

from __future__ import annotations

from kvferry.connector.engine_kv import UnsupportedKVLayout

ROW_ALIGN = 16  # bytes: a row is a whole number of these where the page has room (wide, aligned copies)


def row_bytes(state_bytes: int, page_bytes: int, chunk_size: int) -> int:
    """Bytes per token row of a state object: ``chunk_size`` rows cover the ``state_bytes`` state region and stay
    within the layer's ``page_bytes`` page; UnsupportedKVLayout when no row width does."""
    for align in (ROW_ALIGN, 2):  # the format's rows are an even number of elements
        width = -(-state_bytes // (chunk_size * align)) * align
        if chunk_size * width <= page_bytes:
            return width
    raise UnsupportedKVLayout(
        f"a Mamba state of {state_bytes} bytes does not fit {chunk_size} whole rows in its {page_bytes}-byte page: "
        "use a chunk size that divides the state's bytes"
    )

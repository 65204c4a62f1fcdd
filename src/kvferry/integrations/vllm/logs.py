"""kvferry's log lines in vLLM's output.

vLLM configures only its own "vllm" logger (a handler, a format, propagation off), so without this the connector's
INFO lines -- that it is active, its layout, mode and chunk size -- and even its warnings go nowhere useful.
"""

from __future__ import annotations

import logging


def show_in_vllm_log() -> None:
    """Send the "kvferry" logger's records through vLLM's handlers (once, however often it is called). Nothing
    changes when vLLM's logging configuration is off (``VLLM_CONFIGURE_LOGGING=0``): the user's applies."""
    vllm_logger = logging.getLogger("vllm")
    ours = logging.getLogger("kvferry")
    if not vllm_logger.handlers:
        return
    for handler in vllm_logger.handlers:
        if handler not in ours.handlers:
            ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(vllm_logger.getEffectiveLevel())
    ours.propagate = False  # vLLM's handlers print them; a root handler would print them twice

"""Launch a compiled Triton kernel with one `cuLaunchKernel` call, its parameter buffer built once.

Why: Triton's Python launcher (argument packing, scratch allocation, hooks) costs ~16 us per launch on the GPU
machine's host, and a staged request launches once per slice. Here the kernel's constant arguments are packed
once; a launch packs the per-request ones with one `struct.pack_into` and makes one ctypes call (~3 us).

Safe by construction: the parameter list is checked against the kernel's real ABI as the driver reports it
(`cuFuncGetParamInfo`: count and size of every parameter). Anything this launcher does not reproduce (global or
profile scratch memory, clusters, cooperative or PDL launches, a launch hook that wants to see launches) makes
`direct_launcher` return None, and the caller keeps Triton's own launcher.
"""

from __future__ import annotations

import ctypes
import logging
import struct
import threading
from typing import Any

import triton

from kvferry.cuda.driver import Driver

log = logging.getLogger(__name__)
_SLOT = 8  # every parameter gets an 8-byte slot of our buffer; the driver copies it by the kernel's own size


class DirectLaunch:
    """`launch(grid, stream, *per_request_args)`: the constant arguments are already in the buffer."""

    def __init__(
        self, drv: Driver, function: int, threads: int, shared: int, sizes: list[int], constants: list[int], extra: int
    ) -> None:
        self._driver = drv
        self._function = function
        self._threads = threads
        self._shared = shared
        n = len(sizes) + extra
        self._buffer = ctypes.create_string_buffer(_SLOT * n)
        base = ctypes.addressof(self._buffer)
        self._params = (ctypes.c_void_p * n)(*[base + _SLOT * i for i in range(n)])  # extras: zeroed (NULL)
        codes = ["q" if size == 8 else "i4x" for size in sizes]  # constants first, then the per-request ones
        struct.pack_into("<" + "".join(codes[: len(constants)]), self._buffer, 0, *constants)
        self._request = struct.Struct("<" + "".join(codes[len(constants) :]))
        self._request_at = _SLOT * len(constants)
        self._lock = threading.Lock()  # the buffer is shared: one launch packs and launches at a time

    def __call__(self, grid: int, stream: int, *args: int) -> None:
        with self._lock:
            self._request.pack_into(self._buffer, self._request_at, *args)
            self._driver.launch(self._function, grid, 1, 1, self._threads, 1, 1, self._shared, stream, self._params,
                                None)  # fmt: skip


def direct_launcher(
    drv: Driver, compiled: Any, arg_names: list[str], constants: list[int], n_request: int
) -> DirectLaunch | None:
    """A direct launcher for `compiled`, or None when its ABI is not the plain one this module reproduces.

    `arg_names` are the kernel's runtime arguments in order: first the constant ones (`constants`, their values),
    then `n_request` per-request ones that must all be unspecialised (Triton then keeps them all as parameters).
    """
    if _hooked():
        _decline("a Triton launch hook is set")
        return None
    meta = compiled.metadata
    plain = (
        getattr(meta, "num_ctas", 1) == 1
        and tuple(getattr(meta, "cluster_dims", (1, 1, 1)) or (1, 1, 1)) in ((1, 1, 1), (0, 0, 0))
        and not getattr(meta, "launch_cooperative_grid", False)
        and not getattr(meta, "launch_pdl", False)
        and not getattr(meta, "global_scratch_size", 0)
        and not getattr(meta, "profile_scratch_size", 0)
    )
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    if not plain or not isinstance(signature, dict):
        _decline(f"not a plain launch: metadata {meta}, signature {signature!r}")
        return None
    if hasattr(compiled, "_init_handles"):
        compiled._init_handles()
    function = getattr(compiled, "function", None)
    sizes = drv.param_sizes(function) if function else None
    if not function or sizes is None:
        _decline("the driver cannot list kernel parameters (cuFuncGetParamInfo needs CUDA 12.4)")
        return None
    kept: list[int] = []  # constants Triton did not fold into the kernel (a stride of 1 becomes a constexpr)
    want: list[int] = []
    for i, name in enumerate(arg_names):
        kind = signature.get(name)
        if kind == "constexpr":
            if i >= len(constants):
                _decline(f"per-request argument {name} was specialised")
                return None
            continue
        if not isinstance(kind, str) or not (kind.startswith("*") or kind in ("i32", "i64")):
            _decline(f"argument {name} has type {kind!r}")
            return None
        want.append(4 if kind == "i32" else 8)
        if i < len(constants):
            kept.append(constants[i])
    extra = len(sizes) - len(want)
    if (
        len(want) - len(kept) != n_request
        or sizes[: len(want)] != want
        or extra not in (0, 1, 2)  # Triton's trailing scratch pointers, unused here (checked above)
        or any(s != 8 for s in sizes[len(want) :])
    ):
        _decline(f"parameter sizes {sizes} are not {want} + scratch pointers")
        return None
    return DirectLaunch(drv, function, 32 * meta.num_warps, meta.shared, want, kept, extra)


def _decline(reason: str) -> None:
    log.debug("Triton's launcher keeps this kernel: %s", reason)


def active_hook(name: str) -> Any:
    """Triton's launch hook `name` if it would do anything, else None (newer Triton keeps an empty HookChain)."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    hook = getattr(runtime, name, None)
    if hook is None or getattr(hook, "calls", True) == []:
        return None
    return hook


def _hooked() -> bool:
    return active_hook("launch_enter_hook") is not None or active_hook("launch_exit_hook") is not None

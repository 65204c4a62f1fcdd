"""How a GPU transfer engine is set up (`kvferry.transfer.gpu_engine.TransferEngine`): its staging ring, slicing,
zero-copy crossover, kernel grid and priority, and which data path it takes. Plain data, importable without
Triton or a GPU."""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.transfer.schedule import MiB

MODES = ("auto", "staged", "zero_copy", "page_dma")


@dataclass(frozen=True)
class EngineConfig:
    """Staging ring per direction (slots x slot_bytes), slice target, zero-copy crossover, kernel grid."""

    slots: int = 2
    slot_bytes: int = 64 * MiB
    slice_bytes: int | None = None  # default: a quarter of the request, 8 MiB .. half a slot
    zero_copy_below: int = 4 * MiB  # requests smaller than this run zero-copy (see docs/gpu_data_path.md)
    mode: str = "auto"  # "auto" (staged or zero-copy by size) | "staged" | "zero_copy" | "page_dma"
    programs: int | None = None  # programs per staged gather/scatter launch (default: two per SM)
    # CUDA stream priority of the gathers/scatters (lower = higher). High: behind a queue of the model's GEMMs a
    # normal-priority gather waits for free SMs and the transfer stalls (0.4 GB/s measured); at high priority it
    # moves 36 GB/s and the GEMM keeps 99% (docs/gpu_data_path.md, "GEMM").
    kernel_priority: int = -1
    batch_dma: bool = True  # a slice's scattered objects as one cuMemcpyBatchAsync where the driver has it
    # A request of one whole object up to this size replays a CUDA graph of its staged transfer, captured for its
    # shape on first use (`graphed`); 0 turns graphs off. In "auto" mode such a request is staged even below
    # `zero_copy_below`: the graph is faster than the zero-copy kernel and leaves the SMs to the model.
    graph_max_bytes: int = 64 * MiB

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} must be one of {MODES}")
        if self.slots < 1 or self.slot_bytes < 1 or (self.programs is not None and self.programs < 1):
            raise ValueError(f"slots, slot_bytes and programs must be positive: {self}")

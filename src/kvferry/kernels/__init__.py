"""Copy backends over the derived geometry: reference (oracle), torch (CPU path), triton (GPU kernels).

Submodules are imported on use: triton is only loaded when the triton backend runs.
"""

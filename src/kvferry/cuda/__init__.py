"""CUDA plumbing the other packages share: driver calls through ctypes, CUDA graphs, and host memory known pinned.

Nothing here needs a GPU to import; the driver is opened on first use.
"""

"""CPU runtime settings shared by `prepare` and `fit`."""

from __future__ import annotations


def keep_freed_memory() -> None:
    """CPU speed-up: glibc hands large freed blocks back to the OS and page-faults fresh zeroed pages in for the
    next step's tensors, which costs as much kernel time as the math. Keep freed memory in the heap instead
    (like GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=...). No-op off glibc."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
    libc.mallopt(M_MMAP_MAX, 0)
    libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
    libc.mallopt(M_TOP_PAD, 256 << 20)

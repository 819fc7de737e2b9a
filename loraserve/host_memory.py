"""Host memory for CPU steps: freed blocks kept for the next step instead of returned to the OS.

A step allocates and frees the same activations again and again (a 1,024-token prefill chunk of
SmolLM2: 2-13 MB per tensor). With glibc's defaults such blocks are mapped fresh (blocks over the
mmap threshold, 128 KiB until the first free raises it) or handed back when the heap's free top
exceeds the trim threshold, so the next step page-faults and the kernel zeroes every page again.
Once per process, for CPU engines, :func:`keep_freed_blocks` raises both thresholds: blocks up to
``MAX_BLOCK_BYTES`` come from the heap and freed memory stays there for reuse. Peak memory is
unchanged; what a step has freed is kept rather than returned.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MAX_BLOCK_BYTES = 32 * 2**20  # glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)
KEEP_FREED_BYTES = 2**30  # freed heap top kept before any is trimmed

_applied: bool | None = None  # None: not tried in this process


def keep_freed_blocks() -> bool:
    """Serve blocks up to ``MAX_BLOCK_BYTES`` from the heap and keep up to ``KEEP_FREED_BYTES`` of
    freed heap for reuse. Process-wide and idempotent (set on the first call only); returns whether
    the C library took both settings (False where it is not glibc, e.g. musl or macOS)."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
    except OSError:
        mallopt = None
    if mallopt is None:
        logger.info("host memory: no mallopt in this C library; freed blocks go back to the OS as it decides")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MAX_BLOCK_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_FREED_BYTES))
    logger.info(
        "host memory: blocks up to %d MiB from the heap, %d MiB of freed heap kept: %s",
        MAX_BLOCK_BYTES >> 20,
        KEEP_FREED_BYTES >> 20,
        "applied" if _applied else "refused by the C library",
    )
    return _applied

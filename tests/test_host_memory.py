"""Freed step memory is reused, not page-faulted in again (loraserve/host_memory.py).

Each case runs in a fresh interpreter, since the setting is process-wide: a step-like cycle
allocates four 24 MiB tensors, writes them and frees them. glibc's own accounting (``mallinfo2``)
says whether the first cycle's blocks were mapped on their own (glibc's default for blocks over
128 KiB in a fresh process; later cycles vary with its adaptive threshold) and how much freed memory
the heap holds after the cycles; the minor page faults of the later cycles are counted too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import subprocess
import sys

import pytest

from loraserve.host_memory import keep_freed_blocks

CYCLE = """
import ctypes, ctypes.util, json, resource, sys
import torch
from loraserve.host_memory import keep_freed_blocks
applied = keep_freed_blocks() if sys.argv[1] == "keep" else None
torch.set_num_threads(1)

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2
mapped = []


def cycle():
    tensors = [torch.empty(6 * 2**20) for _ in range(4)]  # 4 x 24 MiB
    for t in tensors:
        t.fill_(1.0)
    mapped.append(libc.mallinfo2().hblkhd)  # bytes in blocks mapped on their own, while they live
    del tensors

cycle()
cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    cycle()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
free_heap = libc.mallinfo2().fordblks
print(json.dumps({"applied": applied, "faults": faults, "free_heap": free_heap, "first_mapped": mapped[0]}))
"""


def _run_cycles(mode: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", CYCLE, mode], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_freed_blocks_are_reused_without_page_faults() -> None:
    if not keep_freed_blocks() or not hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "mallinfo2"):
        pytest.skip("this C library is not glibc >= 2.33 (no mallopt or mallinfo2)")
    default, kept = _run_cycles("default"), _run_cycles("keep")
    assert kept["applied"] is True
    cycle_bytes = 4 * 24 * 2**20
    pages_per_cycle = cycle_bytes // 4096
    assert default["first_mapped"] >= cycle_bytes, default  # glibc's default: each block mapped on its own
    assert kept["first_mapped"] < 24 * 2**20, kept  # from the heap
    assert kept["free_heap"] >= cycle_bytes, kept  # all four kept for the next cycle
    assert kept["faults"] < pages_per_cycle, kept  # 8 cycles fault in less than one cycle's pages


def test_keep_freed_blocks_is_idempotent() -> None:
    first = keep_freed_blocks()
    assert keep_freed_blocks() is first  # set once per process; later calls report the first result

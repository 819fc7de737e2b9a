"""A debug mode for the Triton kernels: check the page ids and slots a launch will read or write.

The compiled CPU kernels check every page id they read (cheaply, on the host, as they go). A GPU
kernel cannot without a device-to-host copy per launch, so the Triton wrappers check only when
``LORASERVE_CHECK_PAGE_IDS=1`` (the tests' conftest sets it): every id in its range, or a
``ValueError`` naming the argument, before the launch. Off (the default), they cost nothing.
"""

from __future__ import annotations

import os

import torch

ENABLED = os.environ.get("LORASERVE_CHECK_PAGE_IDS") == "1"


def _checks(values: torch.Tensor) -> bool:
    """Whether to check ``values`` now: the debug mode is on, and no CUDA graph is being recorded
    (it may not read the device; its eager warm-up was checked)."""
    if not ENABLED or values.numel() == 0:
        return False
    return not (values.is_cuda and torch.cuda.is_current_stream_capturing())


def check_range(name: str, ids: torch.Tensor, low: int, high: int) -> None:
    """With the debug mode on: every element of ``ids`` in ``[low, high)``, or a ValueError."""
    if not _checks(ids):
        return
    smallest, largest = int(ids.min()), int(ids.max())
    if smallest < low or largest >= high:
        bad = smallest if smallest < low else largest
        raise ValueError(f"{name}: {bad} is outside [{low}, {high}) (a page id or slot outside the pool)")


def check_multiples(name: str, values: torch.Tensor, factor: int) -> None:
    """With the debug mode on: every element of ``values`` a multiple of ``factor``, or a ValueError."""
    if not _checks(values):
        return
    bad = values[values % factor != 0]
    if bad.numel():
        raise ValueError(f"{name}: {int(bad[0])} is not a multiple of {factor} (not as lora/layout.py lays weights)")
